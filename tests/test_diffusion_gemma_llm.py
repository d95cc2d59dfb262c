"""DiffusionGemma through the offline API, ``dllm generate``, ``serve``, ``playground`` and
``bench``: ``LLM(folder)`` of a ``diffusion_gemma`` checkpoint (``tiny_diffusion_gemma``: the
released layout) gives a ``CanvasLLM``. Its answers are the sampler's (``generate`` with the
request's seed, alone), cut at EOS and at ``max_new_tokens``, in any batch, batch size and order;
its counts are the work the sampler did; what does not apply to the family is refused, naming it.

Its answers are the sampler's on the batches it forms (``batched``), not a prompt's alone: the
draws, positions and stops of a row do not depend on the rows beside it, but the kernels' rounding
does (a vectorised kernel's scalar tail falls elsewhere in a longer tensor), and self-conditioning
amplifies it step after step (docs/models/diffusion-gemma.md#batch-invariance)."""
import importlib.util
import json
import random
import re
from pathlib import Path

import httpx
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.cli import main
from dllm_engine.decoding.diffusion_gemma import SeededDraws, generate, load_generation_settings
from dllm_engine.engine.canvas_llm import METHOD, CanvasLLM, Request
from dllm_engine.errors import UserError
from dllm_engine.models.diffusion_gemma import load_diffusion_gemma
from dllm_engine.models.loader import named_tensors
from dllm_engine.sampling_params import ParamError
from dllm_engine.seeds import choice_seeds
from fixtures import serving
from tiny_diffusion_gemma import CANVAS, EOS, PAD, SPECIAL, VOCAB, WORDS, write_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-diffusion-gemma"))


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(folder)


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))] for _ in range(count)]


def batched(llm, rows: list[list[int]], seeds: list[int], max_new_tokens: int = 3 * CANVAS) -> list[list[int]]:
    """The sampler's answers for ``rows`` run together (left-padded, one seed each), each cut at
    its first EOS and at max_new_tokens."""
    settings = load_generation_settings(llm.path, (EOS,), PAD)
    settings = settings if max_new_tokens == settings.max_new_tokens else \
        type(settings)(**{**settings.__dict__, "max_new_tokens": max_new_tokens})
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = generate(llm.model, ids, settings, SeededDraws(seeds), attention_mask=mask, batch_invariant=True)
    return [row[:min(max_new_tokens, row.index(EOS) if EOS in row else len(row))] for row in out.token_ids.tolist()]


def alone(llm, ids: list[int], seed: int, max_new_tokens: int = 3 * CANVAS) -> list[int]:
    return batched(llm, [ids], [seed], max_new_tokens)[0]


def test_llm_of_a_diffusion_gemma_folder_is_the_canvas_llm(llm):
    assert isinstance(llm, CanvasLLM) and llm.family == "diffusion_gemma"
    params = llm.resolve(SamplingParams(seed=5))
    assert params.describe() == ("diffusion-gemma max_new_tokens=18 canvas_length=6 steps=6 entropy_bound=1.0 "
                                 "t_max=0.5 t_min=0.05 stability_threshold=0 confidence_threshold=0.8 "
                                 "stop_at_eos=True seed=5")
    assert llm.resolve(SamplingParams(max_new_tokens=4, steps=3)).settings.max_denoising_steps == 3


def test_each_answer_is_the_samplers_on_the_batches_it_forms(folder, llm):
    rows = prompts(6)
    seeds = [11, 12, 13, 14, 15, 16]
    want = batched(llm, rows, seeds)
    assert any(len(w) == 3 * CANVAS for w in want) and any(len(w) < 3 * CANVAS for w in want)  # some stop at EOS
    out = llm.generate(rows, [SamplingParams(seed=s) for s in seeds])
    assert [o.token_ids for o in out] == want
    two_at_a_time = LLM(folder, max_num_seqs=2).generate(rows, [SamplingParams(seed=s) for s in seeds])
    assert [o.token_ids for o in two_at_a_time] == [w for i in range(0, 6, 2)
                                                    for w in batched(llm, rows[i:i + 2], seeds[i:i + 2])]
    # settings apart (here max_new_tokens) run apart, each batch in prompt order
    mixed = llm.generate(rows[:3], [SamplingParams(seed=11), SamplingParams(seed=12, max_new_tokens=5),
                                    SamplingParams(seed=13)])
    pair = batched(llm, [rows[0], rows[2]], [11, 13])
    assert [o.token_ids for o in mixed] == [pair[0], alone(llm, rows[1], 12, 5), pair[1]]
    for o, w in zip(out, want):
        assert o.finish_reason == ("stop" if len(w) < 3 * CANVAS else "length")
        assert o.text == " ".join(WORDS[t] for t in w if t not in SPECIAL)


def test_counts_are_the_work_the_sampler_did(llm):
    out = llm.generate(prompts(3), SamplingParams(seed=7))
    for o in out:
        steps = o.canvas_steps
        assert 1 <= len(steps) <= 3 and all(1 <= s <= 6 for s in steps)
        s = o.stats
        assert s.nfe == sum(steps) + len(steps)  # decoder steps, the prompt's and later canvases' encoder passes
        assert s.decoded_tokens == len(steps) * CANVAS and s.output_tokens == len(o.token_ids)
        assert s.prefill_tokens == len(o.prompt_token_ids)
        assert s.processed_tokens == len(o.prompt_token_ids) + sum(steps) * CANVAS + (len(steps) - 1) * CANVAS
    assert out.stats.nfe == sum(o.stats.nfe for o in out) and out.method == METHOD


def test_max_new_tokens_n_copies_and_the_seed_stream(llm):
    ids = prompts(1)[0]
    short = llm.generate([ids], SamplingParams(seed=3, max_new_tokens=4))[0]
    assert short.token_ids == alone(llm, ids, 3, 4) and len(short.canvas_steps) == 1  # one canvas runs
    copies = llm.generate([ids], SamplingParams(seed=3, n=2))[0]
    assert [c.token_ids for c in copies] == batched(llm, [ids, ids], choice_seeds(3, 2))
    assert copies[0].token_ids != copies[1].token_ids
    a = LLM(llm.path, seed=9).generate([ids, ids])
    b = LLM(llm.path, seed=9).generate([ids, ids])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # the stream repeats
    assert a[0].token_ids != a[1].token_ids  # and gives each request its own seed


def test_record_steps_traces_every_denoising_step_and_changes_nothing(llm):
    rows, seeds = prompts(3), [21, 22, 23]
    plain = llm.generate(rows, [SamplingParams(seed=s) for s in seeds])
    traced = llm.generate(rows, [SamplingParams(seed=s, record_steps=True) for s in seeds[:2]]
                          + [SamplingParams(seed=seeds[2])])
    assert [o.token_ids for o in traced] == [o.token_ids for o in plain] and traced[2].steps is None
    for o in traced[:2]:
        per_canvas = [[s for s in o.steps if s.canvas == c] for c in range(len(o.canvas_steps))]
        assert [len(c) for c in per_canvas] == o.canvas_steps and len(o.steps) == sum(o.canvas_steps)
        assert all([s.step for s in c] == list(range(len(c))) for c in per_canvas)
        # a canvas ends when it stops (stable and confident) or runs out of steps
        assert all(c[-1].finished or len(c) == 6 for c in per_canvas)
        assert all(not s.finished for c in per_canvas for s in c[:-1])
        kept = [t for c in per_canvas for t in c[-1].argmax_ids]  # each canvas keeps its last argmax
        assert o.token_ids == kept[:len(o.token_ids)] and (len(o.token_ids) == len(kept) or kept[len(o.token_ids)] == EOS)
        first = o.steps[0]
        assert first.text == [WORDS[t] for t in first.argmax_ids] and len(first.accepted) == CANVAS


def test_stop_token_ids_end_the_answer_with_or_without_stop_at_eos(llm):
    ids = prompts(1)[0]
    full = llm.generate([ids], SamplingParams(seed=3, stop_at_eos=False))[0]
    stop = next(t for t in full.token_ids[1:] if t != EOS)  # a token the answer writes after its first
    for params in (SamplingParams(seed=3, stop_token_ids=[stop]), SamplingParams(seed=3, stop_token_ids=[stop],
                                                                                stop_at_eos=False)):
        out = llm.generate([ids], params)[0]
        assert stop not in out.token_ids and out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[:len(out.token_ids)]


def test_text_and_chat_prompts(llm):
    text = llm.generate("w5 w6 w7", SamplingParams(seed=1))[0]
    assert text.prompt_token_ids == [5, 6, 7] and text.token_ids == alone(llm, [5, 6, 7], 1)
    chat = llm.chat([{"role": "user", "content": "w5 w6 w7"}], SamplingParams(seed=1))[0]
    assert chat.prompt_token_ids == [5, 6, 7] and chat.token_ids == text.token_ids


@pytest.mark.parametrize("given, field, says", [
    (SamplingParams(method="dual-cache"), "method", "own entropy-bound sampler"),
    (SamplingParams(temperature=0.7), "temperature", "falls from t_max to t_min"),
    (SamplingParams(threshold=0.9), "threshold", "masked-diffusion decoders"),
    (SamplingParams(logprobs=2), "logprobs", "renoised canvas"),
    (SamplingParams(block_length=4), "block_length", "canvases of its canvas_length, 6"),
    (SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids", "ids in [0, 96)"),
    (SamplingParams(max_new_tokens=60), "max_new_tokens", "the model has 64"),
])
def test_what_does_not_apply_is_refused_naming_it(llm, given, field, says):
    with pytest.raises(ParamError, match=re.escape(says)) as refused:
        llm.generate(prompts(1)[0], given)
    assert refused.value.param == field


def test_a_memory_budget_sizes_the_batches_and_refuses_what_cannot_fit(folder, llm, monkeypatch):
    rows, seeds = prompts(6), [11, 12, 13, 14, 15, 16]
    requests = [Request(i, r, llm.resolve(SamplingParams(seed=s))) for i, (r, s) in enumerate(zip(rows, seeds))]
    two = llm.batch_bytes(requests[:2])
    assert llm.batch_bytes(requests[:1]) < two < llm.batch_bytes(requests[:3])
    budgeted = LLM(folder, kv_cache_memory=two)
    sizes = []
    run_batch = CanvasLLM.run_batch
    monkeypatch.setattr(CanvasLLM, "run_batch", lambda self, batch: sizes.append(len(batch)) or run_batch(self, batch))
    out = budgeted.generate(rows, [SamplingParams(seed=s) for s in seeds])
    assert sizes == [2, 2, 2]  # what fits the budget (max_num_seqs is 256)
    assert [o.token_ids for o in out] == [w for i in range(0, 6, 2) for w in batched(llm, rows[i:i + 2], seeds[i:i + 2])]
    with pytest.raises(UserError, match=r"needs [0-9.]+ MiB for its sampler .* more than the [0-9.]+ MiB budget"):
        LLM(folder, kv_cache_memory=llm.batch_bytes(requests[:1]) - 1).generate(rows[:1], SamplingParams(seed=1))
    assert sizes == [2, 2, 2]  # refused before anything ran


def test_out_of_memory_halves_the_batch_and_lowers_the_budget(folder, llm, monkeypatch):
    rows, seeds = prompts(4), [41, 42, 43, 44]
    fresh = LLM(folder)
    sample, sizes = CanvasLLM.sample, []

    def tight(self, batch, on_canvas=None):  # a device that holds two rows at a time
        sizes.append(len(batch))
        if len(batch) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return sample(self, batch, on_canvas)
    monkeypatch.setattr(CanvasLLM, "sample", tight)
    out = fresh.generate(rows, [SamplingParams(seed=s) for s in seeds])
    assert sizes == [4, 2, 2]
    assert [o.token_ids for o in out] == batched(llm, rows[:2], seeds[:2]) + batched(llm, rows[2:], seeds[2:])
    four = [Request(i, r, fresh.resolve(SamplingParams(seed=s))) for i, (r, s) in enumerate(zip(rows, seeds))]
    assert fresh.budget == fresh.batch_bytes(four) - 1  # later batches stay below what failed
    fresh.generate(rows, [SamplingParams(seed=s) for s in seeds])
    assert sizes[3:] == [3, 1, 2, 1]  # three rows fit under it, fail, and lower it again ...
    again = fresh.generate(rows, [SamplingParams(seed=s) for s in seeds])
    assert sizes[7:] == [2, 2]  # ... to what the device holds: nothing fails from then on
    assert [o.token_ids for o in again] == [o.token_ids for o in out]
    with pytest.raises(torch.OutOfMemoryError):  # one row that cannot fit: the error, as it is
        monkeypatch.setattr(CanvasLLM, "sample", lambda self, batch, on_canvas=None: (_ for _ in ()).throw(
            torch.OutOfMemoryError("CUDA out of memory (simulated)")))
        fresh.generate(rows[:1], SamplingParams(seed=1))


def test_engine_options_that_do_not_apply_are_refused(folder):
    with pytest.raises(UserError, match="fixed_shapes, compile_step: not available for diffusion_gemma yet"):
        LLM(folder, fixed_shapes=True, compile_step=True)
    with pytest.raises(UserError, match="compile is for one process"):
        LLM(folder, compile=True, tensor_parallel_size=2)
    with pytest.raises(UserError, match="quantization int4 runs on CUDA only"):
        LLM(folder, quantization="int4")
    with pytest.raises(UserError, match="prompt token 96 is not an id in"):
        LLM(folder).generate([3, 96])


def test_int8_quantizes_the_linear_layers_and_the_stacked_experts_on_load(folder, llm):
    """Every linear layer but the routers' and every stacked expert weight become torchao's int8
    tensors (the embedding, the tied head, norms and routers stay); the logits are those of the
    same model holding the dequantized weights, and the sampler runs on them, seeded."""
    pytest.importorskip("torchao")
    from dllm_engine.models.quantize import linears, weight_bytes
    quant = LLM(folder, quantization="int8")
    model, layers = quant.model, len(quant.model.layers)
    assert model.quantization.describe() == f"int8: {len(linears(model))} linear layers quantized, " \
                                             f"{2 * layers} stacked expert weights"
    assert all(type(layer.experts.down_proj.data) is not torch.Tensor for layer in model.layers)
    assert all(type(layer.router.proj.weight.data) is torch.Tensor for layer in model.layers)
    assert weight_bytes(model) < 0.5 * weight_bytes(llm.model)
    plain = load_diffusion_gemma(folder)  # the same weights, each quantized one replaced by its dequantization
    plain_tensors = named_tensors(plain)
    with torch.no_grad():
        for name, tensor in named_tensors(model).items():
            if type(tensor.data) is not torch.Tensor:
                plain_tensors[name].copy_(tensor.dequantize())
    ids, canvas = torch.tensor([[2, 5, 6, 7, 8]]), torch.tensor([[5, 9, 13, 17, 21, 25]])
    caches = [m.new_cache() for m in (model, plain)]
    for m, cache in zip((model, plain), caches):
        m.encode(ids, cache)
    got, want = (m.decode(canvas, cache) for m, cache in zip((model, plain), caches))
    assert torch.allclose(got, want, atol=1e-4) and not torch.allclose(got, llm.model.decode(canvas, caches[1]),
                                                                        atol=1e-4)
    rows = prompts(3)
    first = quant.generate(rows, SamplingParams(seed=1))
    assert [o.token_ids for o in first] == [o.token_ids for o in quant.generate(rows, SamplingParams(seed=1))]
    assert all(o.stats.nfe > 0 for o in first)


def test_dllm_generate_runs_it(folder, capsys):
    assert main(["generate", "--model", str(folder), "--prompt", "w5 w6 w7", "--seed", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "method: diffusion-gemma max_new_tokens=18 canvas_length=6" in out
    assert "seed: 1 (--seed 1 samples the same answer again)" in out and "output: " in out
    want = LLM(folder, seed=1).chat([{"role": "user", "content": "w5 w6 w7"}])[0].text  # the stream seeded 1
    assert f"output: {want}\n" in out
    assert main(["generate", "--model", str(folder), "--prompt", "w5 w6 w7", "--seed", "1", "--threads", "1",
                 "--show-steps"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("canvas ")]
    assert lines[0].startswith("canvas 0 step  0: ") and " accepted" in lines[0] and " | " in lines[0]
    assert main(["generate", "--model", str(folder), "--prompt", "w5", "--method", "block"]) == 2
    assert "does not apply to diffusion_gemma" in capsys.readouterr().err
    # --method may name its sampler, with the fields it reads; a masked-diffusion checkpoint refuses it
    assert main(["generate", "--model", str(folder), "--prompt", "w5 w6 w7", "--seed", "1", "--threads", "1",
                 "--method", f"{METHOD}:steps=3"]) == 0
    want = LLM(folder, seed=1).chat([{"role": "user", "content": "w5 w6 w7"}], SamplingParams(steps=3))[0].text
    assert f"output: {want}\n" in capsys.readouterr().out
    tiny_llada = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-llada"
    assert main(["generate", "--model", str(tiny_llada), "--prompt", "sort : b a", "--method", METHOD]) == 2
    assert "--method diffusion-gemma is DiffusionGemma's sampler; " in capsys.readouterr().err


def test_dllm_bench_measures_its_sampler_at_each_batch_size(folder, llm, tmp_path, capsys):
    file = tmp_path / "prompts.jsonl"
    texts = [" ".join(f"w{t}" for t in ids) for ids in prompts(4)]
    file.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    specs = [f"{METHOD}:seed=3", f"{METHOD}:seed=3,steps=3"]
    out = tmp_path / "bench"
    assert main(["bench", "--model", str(folder), "--methods", *specs, "--batch-sizes", "1,4", "--prompts",
                 str(file), "--out", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"method: {specs[1]} = {METHOD} max_new_tokens=18 canvas_length=6 steps=3" in printed
    rows = json.loads((out / "results.json").read_text())
    assert [(r["method"], r["batch_size"]) for r in rows] == [(s, b) for b in (1, 4) for s in specs]
    assert (out / "throughput.png").stat().st_size > 0 and "| `diffusion-gemma:seed=3` | 4 |" in (out / "table.md").read_text()
    for row in rows:  # the counts are the offline API's for the same prompts and seed, batched alike
        params = SamplingParams(seed=3, steps=3 if "steps=3" in row["method"] else None)
        chats = [[{"role": "user", "content": t}] for t in texts]
        outs = [o for i in range(0, 4, row["batch_size"]) for o in llm.chat(chats[i:i + row["batch_size"]], params)]
        assert row["accuracy"] is None and row["output_tokens"] == sum(len(o.token_ids) for o in outs)
        assert row["nfe"] == sum(o.stats.nfe for o in outs) and row["decoded_tokens"] == sum(
            o.stats.decoded_tokens for o in outs)
        assert row["throughput"] > 0 and row["seconds"] > 0
    with_flags = ["bench", "--model", str(folder), "--methods", METHOD, "--prompts", str(file), "--out", str(out / "x")]
    if importlib.util.find_spec("torchao") is not None:  # int8 beside the checkpoint's weights, one model
        assert main([*with_flags, "--compare-quantization", "int8", "--batch-sizes", "1", "--threads", "1"]) == 0
        plain, int8 = json.loads((out / "x" / "results.json").read_text())
        assert (plain["method"], int8["method"]) == (METHOD, f"{METHOD} [int8]")
        assert 0 < int8["weight_mb"] < 0.5 * plain["weight_mb"] and int8["output_tokens"] > 0
    assert main([*with_flags, "--fixed-shapes"]) == 2
    assert "--fixed-shapes: not available for diffusion_gemma" in capsys.readouterr().err
    assert main(["bench", "--model", str(folder), "--methods", "block", "--prompts", str(file),
                 "--out", str(out / "y")]) == 2
    assert "spec 'block': 'block': a diffusion_gemma model runs its own sampler" in capsys.readouterr().err


def test_dllm_profile_counts_a_denoising_steps_ops_and_host_reads_outside_and_inside_the_forwards(folder, capsys):
    assert main(["profile", "--model", str(folder), "--methods", f"{METHOD}:seed=3", "--batch-sizes", "1,4",
                 "--prompts", str(prompts_file(folder.parent)), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(f"| `{METHOD}:seed=3`")]
    assert [int(r[3]) for r in rows] == [1, 4]
    for r in rows:
        steps, ops_out, ops_in, reads_out = int(r[5]), float(r[13]), float(r[15]), float(r[17])
        assert steps > 0 and 0 < ops_out < ops_in and reads_out > 0
    assert int(rows[1][5]) <= int(rows[0][5])  # four prompts in one batch: no more steps than one at a time
    assert main(["profile", "--model", str(folder), "--methods", METHOD, "--breakdown"]) == 2
    assert "--breakdown: not available for diffusion_gemma's profile" in capsys.readouterr().err


def prompts_file(where):
    file = where / "canvas-prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt": " ".join(f"w{t}" for t in ids)}) + "\n" for ids in prompts(4)))
    return file


def test_commands_that_do_not_run_it_refuse_it_before_loading(folder, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the refusal")
    monkeypatch.setattr("dllm_engine.engine.canvas_llm.load_diffusion_gemma", no_load)
    assert main(["chain-probe", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "error: dllm chain-probe does not run diffusion_gemma yet: its sampler runs from Python" in err, err


def test_dllm_eval_grades_its_answers_on_the_task_suite(folder, llm, capsys):
    assert main(["eval", "--model", str(folder), "--tasks", "sort", "--limit", "3", "--batch-size", "2",
                 "--method", f"{METHOD}:steps=3", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "method: diffusion-gemma max_new_tokens=18 canvas_length=6 steps=3" in out
    assert re.search(r"^sort +3 +[0-9.]+% ", out, re.M) and re.search(r"^mean +3 .*throughput [0-9.]+ tok/s", out, re.M)


# -- dllm playground ------------------------------------------------------------------------------
CANVAS_SLOT = re.compile(r'<span class="slot tok (kept|acc|noise)[^"]*" data-canvas="(\d+)" data-pos="(\d+)" '
                         r'data-tok="(\d+)"')


def parse_canvases(page: str) -> tuple[int, list[tuple[str, list[int]]]]:
    """(the step a canvas pane shows; each canvas shown: its slots' states and tokens)."""
    step = int(re.search(r'data-step="(-?\d+)"', page).group(1))
    canvases: dict[int, list] = {}
    for state, canvas, pos, tok in CANVAS_SLOT.findall(page):
        canvases.setdefault(int(canvas), []).append((state, int(tok)))
        assert int(pos) == len(canvases[int(canvas)]) - 1
    return step, [([s for s, _ in c], [t for _, t in c]) for c in canvases.values()]


def test_playground_replays_each_denoising_step_and_answers_as_chat(llm):
    pytest.importorskip("gradio", reason="the ui extra: pip install 'dllm-engine[ui]'")
    from dllm_engine.playground.app import Playground
    pg = Playground(llm)
    assert pg.methods == (METHOD, f"{METHOD}:steps=3")  # the checkpoint's 6 steps a canvas, and half
    message, specs = "w5 w6 w7", (f"{METHOD}:seed=4", f"{METHOD}:seed=4,steps=3")
    frames = list(pg.send(message, *specs, replay_seconds=0))
    *replay, final = frames
    for k, spec in enumerate(specs):
        want = llm.chat([{"role": "user", "content": message}],
                        SamplingParams(seed=4, steps=None if k == 0 else 3, record_steps=True))[0]
        assert final[2 + k] == want.text  # the pane's answer is the offline API's, same seed
        trace = final[5 + k]
        assert trace["spec"] == spec and len(trace["steps"]) == len(want.steps)
        shown = [parse_canvases(f[k]) for f in replay] + [parse_canvases(final[k])]
        steps = [step for step, _ in shown]
        assert steps == sorted(steps) and steps[0] == -1 and steps[-1] == len(want.steps) - 1
        for at, canvases in shown[1:]:
            record = want.steps[at]
            assert len(canvases) == record.canvas + 1  # the kept canvases, then the current one
            for c, (states, ids) in enumerate(canvases[:-1]):
                last = [s for s in want.steps if s.canvas == c][-1]
                assert states == ["kept"] * CANVAS and ids == last.argmax_ids
            states, ids = canvases[-1]
            if record is [s for s in want.steps if s.canvas == record.canvas][-1]:  # it stops: its argmax kept
                assert states == ["kept"] * CANVAS and ids == record.argmax_ids
            else:  # the redrawn canvas: accepted draws, renoised positions
                assert ids == record.token_ids
                assert states == ["acc" if a else "noise" for a in record.accepted]
        kept = [t for _, ids in shown[-1][1] for t in ids]
        assert kept[:len(want.token_ids)] == want.token_ids
    assert "ran at" in final[4] and "nfe" in final[4]


def test_playground_shows_a_masked_diffusion_spec_refused_in_its_pane(llm):
    pytest.importorskip("gradio", reason="the ui extra: pip install 'dllm-engine[ui]'")
    from dllm_engine.playground.app import Playground, build_app
    page = list(Playground(llm).send("w5", METHOD, "block+focus", replay_seconds=0))
    assert len(page) == 1 and "runs its own sampler; give diffusion-gemma" in page[0][1] and "Pane B" in page[0][4]
    assert build_app(llm) is not None  # the page builds for the family: its header, legend and panes


# -- dllm serve ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(folder):
    with serving(LLM(folder, max_num_seqs=4)) as (url, _):
        yield url


def test_the_server_answers_as_the_offline_api(served, llm):
    ids = prompts(2)[1]
    body = {"model": "tiny", "prompt": ids, "seed": 5}
    answer = httpx.post(f"{served}/v1/completions", json=body, timeout=60).json()
    want = llm.generate([ids], SamplingParams(seed=5))[0]  # a request alone is a batch of one
    choice, = answer["choices"]
    assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
    assert answer["usage"]["completion_tokens"] == len(want.token_ids)
    two = httpx.post(f"{served}/v1/completions", json={**body, "n": 2}, timeout=60).json()
    assert [c["text"] for c in two["choices"]] == [o.text for o in llm.generate([ids], SamplingParams(seed=5, n=2))[0]]
    chat = httpx.post(f"{served}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "w5 w6 w7"}], "seed": 1}).json()
    assert chat["choices"][0]["message"]["content"] == llm.chat([{"role": "user", "content": "w5 w6 w7"}],
                                                                SamplingParams(seed=1))[0].text


def test_the_server_streams_by_canvas(served, llm):
    rows = prompts(8)
    seeds = range(30, 38)
    # a prompt whose answer runs more than one canvas: its text arrives in more than one chunk
    ids, seed = next((r, s) for r, s in zip(rows, seeds)
                     if len(llm.generate([r], SamplingParams(seed=s))[0].canvas_steps) > 1)
    want = llm.generate([ids], SamplingParams(seed=seed))[0]
    with httpx.stream("POST", f"{served}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": ids, "seed": seed, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == want.text and len([t for t in texts if t]) > 1
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason


def test_the_server_refuses_what_does_not_apply_and_names_the_family(served):
    bad = httpx.post(f"{served}/v1/completions", json={"model": "tiny", "prompt": [5, 6], "temperature": 0.7},
                     timeout=60)
    assert bad.status_code == 400 and "does not apply to diffusion_gemma" in bad.json()["error"]["message"]
    model, = httpx.get(f"{served}/v1/models", timeout=60).json()["data"]
    assert model["model_type"] == "diffusion_gemma" and model["methods"] == ["diffusion-gemma"]
    assert model["defaults"].startswith("diffusion-gemma max_new_tokens=18 canvas_length=6")
    assert "dllm_requests_total" in httpx.get(f"{served}/metrics", timeout=60).text


def wait_for(check, what: str | None = None, seconds: float = 60) -> bool:
    """Poll ``check()`` every 50 ms for up to ``seconds``; whether it came true. With ``what``,
    not coming true is an AssertionError naming it (inside the engine's thread, give none: the
    caller's assertions then say what went wrong)."""
    import threading
    for _ in range(int(seconds / 0.05)):
        if check():
            return True
        threading.Event().wait(0.05)
    if what is not None:
        raise AssertionError(f"timed out waiting for {what}")
    return False


def test_the_server_batches_by_step_a_late_request_joins_at_the_next_step(folder, monkeypatch):
    """Continuous batching by denoising step: a gate holds the loop before each step, so the
    schedule is the test's. A four-canvas request runs alone; a one-canvas request sent while
    its second step is held joins before its third (the loop takes queued requests between two
    steps, not only between two canvases), runs in the same forwards, and is answered while the
    first goes on. Both answers are whole; the late one's tokens are its sampler's in that batch
    (docs/models/diffusion-gemma.md#batch-invariance)."""
    import threading

    from dllm_engine.decoding.diffusion_gemma import CanvasBatch
    gate, entered = threading.Semaphore(0), []
    real = CanvasBatch.run_step

    def gated(run):
        entered.append(len(run))  # the rows live or joining at this step
        assert gate.acquire(timeout=60)
        return real(run)
    monkeypatch.setattr(CanvasBatch, "run_step", gated)
    answers = {}

    def ask(name, **fields):
        body = {"model": "tiny", "stop_at_eos": False, **fields}
        answers[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()

    with serving(LLM(folder, max_num_seqs=4)) as (url, app):
        engine = app.state.server.engine
        first = threading.Thread(target=ask, args=("long",), kwargs=dict(prompt="w5 w6 w7", max_tokens=24, seed=1))
        first.start()
        wait_for(lambda: len(entered) == 1, "the first step")
        gate.release()  # step 0 of the long request's first canvas, alone
        wait_for(lambda: len(entered) == 2, "the second step")
        late = threading.Thread(target=ask, args=("short",), kwargs=dict(prompt="w8 w9", max_tokens=6, seed=2))
        late.start()
        wait_for(lambda: engine.queue_depth() == 1, "the late request to queue")
        gate.release()  # step 1 of the long one; the late one waits in the queue
        wait_for(lambda: len(entered) == 3, "the third step")
        assert entered == [1, 1, 2] and engine.num_running() == 2 and engine.queue_depth() == 0  # it joined mid-canvas
        while late.is_alive():  # step by step until the late one is answered
            gate.release()
            count = len(entered)
            wait_for(lambda: len(entered) > count or not late.is_alive(), "the next step")
        assert first.is_alive() and entered[-1] == 1  # answered; the long one goes on alone
        gate.release(1000)
        first.join(timeout=60)
    assert not first.is_alive()
    for name, most in (("long", 24), ("short", 6)):  # answers cut at their first EOS, as every answer is
        choice, = answers[name]["choices"]
        assert 0 <= answers[name]["usage"]["completion_tokens"] <= most and choice["finish_reason"] in ("stop", "length")


def test_a_client_that_leaves_frees_its_row_before_the_next_step(folder, monkeypatch):
    import threading

    from dllm_engine.decoding.diffusion_gemma import CanvasBatch
    gate, entered = threading.Semaphore(0), []
    real = CanvasBatch.run_step

    def gated(run):
        entered.append(len(run))
        assert gate.acquire(timeout=60)
        return real(run)
    monkeypatch.setattr(CanvasBatch, "run_step", gated)
    gone = []

    def ask():  # gives up after 2 s, while its first canvas is held
        try:
            httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 24,
                                                       "stop_at_eos": False}, timeout=2)
        except httpx.TimeoutException:
            gone.append(True)

    with serving(LLM(folder, max_num_seqs=4)) as (url, app):
        engine = app.state.server.engine
        client = threading.Thread(target=ask)
        client.start()
        client.join(timeout=60)
        assert gone and entered == [1] and engine.num_running() == 1
        threading.Event().wait(1.0)  # the server polls for a departed client (POLL_S)
        gate.release()  # its first step runs; before the second it leaves the group
        wait_for(lambda: len(entered) == 2, seconds=30)
        assert entered == [1, 0] and engine.num_running() == 0  # its row left: a four-canvas request ran one step
        gate.release()

def test_an_out_of_memory_in_a_server_group_requeues_its_requests_under_a_lower_budget(folder, monkeypatch):
    """An injected ``torch.OutOfMemoryError`` in a step of three rows: the budget falls below
    their bytes, the three (nothing sent yet) queue again and run in smaller groups; every
    request is answered."""
    import threading

    from dllm_engine.decoding.diffusion_gemma import CanvasBatch
    real, calls = CanvasBatch.run_step, []

    def failing(run):
        calls.append(len(run))
        if len(calls) == 1:  # hold the first step until the other two requests queue
            wait_for(lambda: engine.queue_depth() == 2)
        if len(run) == 3 and 3 not in calls[:-1]:
            raise torch.OutOfMemoryError("injected")
        return real(run)
    monkeypatch.setattr(CanvasBatch, "run_step", failing)
    answers = []

    def ask(prompt):
        answers.append(httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "seed": 4,
                                                                  "max_tokens": 12, "stop_at_eos": False}, timeout=120))

    llm = LLM(folder, max_num_seqs=4)
    with serving(llm) as (url, app):
        engine = app.state.server.engine
        threads = [threading.Thread(target=ask, args=(p,)) for p in ("w5 w6 w7", "w8 w9", "w10 w11 w12 w13")]
        for t in threads:
            t.start()
            threading.Event().wait(0.2)
        for t in threads:
            t.join(timeout=120)
    assert [r.status_code for r in answers] == [200] * 3 and all(r.json()["choices"] for r in answers)
    assert 3 in calls and max(calls[calls.index(3) + 1:]) < 3  # after the failure, smaller groups
    three = [Request(0, ids, llm.resolve(SamplingParams(max_new_tokens=12, stop_at_eos=False)))
             for ids in ([5, 6, 7], [8, 9], [10, 11, 12, 13])]
    assert llm.budget < llm.batch_bytes(three)


def test_a_dead_rank_ends_the_server_loop_with_503s(folder, monkeypatch):
    """A ``WorkerDied`` in a canvas (a tensor-parallel rank exited): the running request, and
    every later one, gets the step loop's 503 naming the cause; ``/health`` answers 503."""
    from dllm_engine.decoding.diffusion_gemma import CanvasBatch
    from dllm_engine.engine.parallel import WorkerDied

    def dead(run):
        raise WorkerDied("rank 1 exited")
    monkeypatch.setattr(CanvasBatch, "run_step", dead)
    body = {"model": "tiny", "prompt": "w5 w6 w7", "seed": 4, "max_tokens": 12}
    with serving(LLM(folder)) as (url, app):
        first = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        later = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        health = httpx.get(f"{url}/health", timeout=60)
        assert not app.state.server.engine.alive()
    for r in (first, later):
        assert r.status_code == 503 and r.json()["error"]["message"] == "engine unavailable: rank 1 exited"
    assert health.status_code == 503


def test_the_server_loop_reports_its_group_bytes_and_the_requests_waiting_for_the_budget(folder, monkeypatch):
    """A budget that fits one row: while the first request's second step runs, the second
    request waits for memory, and ``memory()`` (what ``/metrics`` shows) says so."""
    import threading

    from dllm_engine.decoding.diffusion_gemma import CanvasBatch
    real, seen = CanvasBatch.run_step, []

    def held(run):
        if not seen:  # the first step: until the second request queues
            wait_for(lambda: engine.queue_depth() == 1)
        seen.append(engine.memory())
        return real(run)
    monkeypatch.setattr(CanvasBatch, "run_step", held)
    params = SamplingParams(max_new_tokens=12, stop_at_eos=False)
    probe = LLM(folder)
    first, second = (Request(0, ids, probe.resolve(params)) for ids in ([5, 6, 7], [8, 9]))
    alone = max(probe.batch_bytes([first]), probe.batch_bytes([second]))
    assert probe.batch_bytes([first, second]) > alone
    answers = []

    def ask(prompt):
        answers.append(httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "seed": 4,
                                                                  "max_tokens": 12, "stop_at_eos": False}, timeout=120))

    with serving(LLM(folder, kv_cache_memory=alone)) as (url, app):
        engine = app.state.server.engine
        threads = [threading.Thread(target=ask, args=(p,)) for p in ("w5 w6 w7", "w8 w9")]
        for t in threads:
            t.start()
            threading.Event().wait(0.2)
        for t in threads:
            t.join(timeout=120)
        text = httpx.get(f"{url}/metrics", timeout=60).text
    assert [r.status_code for r in answers] == [200, 200]
    assert seen[:2] == [(alone, probe.batch_bytes([first]), 0), (alone, probe.batch_bytes([first]), 1)]
    assert engine.memory() == (alone, 0, 0)  # nothing runs or waits any more
    assert f"dllm_kv_cache_memory_budget_bytes {alone}" in text and "dllm_waiting_for_memory 0" in text


# -- lm-eval ---------------------------------------------------------------------------------------
def test_the_lm_eval_model_generates_through_the_canvas_sampler(folder, llm):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from dllm_engine.integrations.lm_eval import CanvasLM, DllmLM
    lm = DllmLM(pretrained=str(folder), seed=7, batch_size=4)
    assert isinstance(lm, CanvasLM)
    requests = [Instance("generate_until", {}, ("w5 w6 w7", {"until": ["w9"], "max_gen_toks": 12}), 0),
                Instance("generate_until", {}, ("w8 w9", {"until": [], "max_gen_toks": 18}), 1)]
    texts = lm.generate_until(requests)
    want = llm.run([[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=12, seed=7),
                                        SamplingParams(max_new_tokens=18, seed=8)], use_tqdm=False)
    assert texts == [want[0].text.split("w9")[0], want[1].text]  # each cut at its own until string
    assert lm.stats.generate_requests == 2 and lm.stats.generate.nfe == want.stats.nfe
    with pytest.raises(NotImplementedError, match="no log-likelihood"):
        lm.loglikelihood([Instance("loglikelihood", {}, ("w5", " w6"), 0)])
    with pytest.raises(UserError, match="leave method out"):
        DllmLM(pretrained=str(folder), method="dual-cache")
