"""One prepared device check: correctness on the device against the CPU, then what a step costs.

    python scripts/gpu_check.py --out DIR                      # on a GPU (make gpu-check)
    python scripts/gpu_check.py --device cpu --tiny --out DIR  # the same, tiny, in CI (< 1 min)

Writes DIR/gpu_check.json and DIR/gpu_check.md. Two parts:

1. **Correctness.** Each embedded checkpoint (tiny-llada, tiny-sdar) decodes held-out prompts on
   the device and on the CPU, for each method: greedy tokens must match (a float32 model; a
   mismatch is reported with the share of rows that agree). A sampled request (temperature 0.6,
   SDAR's chat default) must run on the device (the draws are counter-based: no CPU generator)
   and its agreement with the CPU is reported. Each method must also decode with attention held
   to SDPA's fused kernels (no math fallback), masks and grouped-query heads included. A random
   DiffusionGemma (its model and sampler from Python: the released layer pattern, MoE, three
   left-padded prompts, seeded draws) samples on the device and on the CPU; the rows that agree
   are counted.
2. **Step cost.** Random-weight models shaped like LLaDA-8B (dense, full attention) and
   LLaDA2.0-mini (MoE, block diffusion), in bfloat16 on the device (``--layers`` of their layers:
   a step's host work does not depend on the depth, its forward grows with it), profiled as
   ``dllm profile`` does: per step the time, the forward alone (``floor``), the share outside
   the forward, host reads and ops outside the layer loop, at each batch size, for the base
   decoder and its strategies; the base decoder also with int8 (and, on CUDA, int4) weights
   and with compiled layers, each row with its weights' size. ``--tiny`` shrinks the shapes
   and runs each model's base decoder and one strategy, without compiling, to run anywhere in
   seconds.
3. **DiffusionGemma's step cost.** A random checkpoint of google/diffusiongemma-26B-A4B-it's
   widths (hidden 2,816, 128 experts of 704, top 8, vocabulary 262,144, canvases of 256) with
   two layers, a sliding one and a global one (2.4B parameters: the vocabulary's embedding is a
   third of them), in bfloat16 through the engine (``dllm profile``'s canvas profile): per
   denoising step the time, the forwards alone, the share outside them, host reads and ops, and
   tokens/s, at batch 1 and 32 (its [batch, canvas, vocab] logits and self-conditioning take
   about 0.5 GB a row), eager and compiled (``--compile``).

Nothing is downloaded; the random checkpoints are written to a temporary folder.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]  # the engine and the lab of this checkout

from dllm_engine import LLM  # noqa: E402
from dllm_engine.bench.canvas_profile import run_canvas_profile  # noqa: E402
from dllm_engine.bench.offline import check_prompts, resolve_specs  # noqa: E402
from dllm_engine.bench.profile import run_profile  # noqa: E402
from dllm_engine.config import ModelConfig, MoEConfig  # noqa: E402
from dllm_engine.models.quantize import weight_bytes  # noqa: E402
from dllm_lab.tasks import load_split  # noqa: E402
from scripts.random_checkpoint import DIFFUSION_GEMMA_SHAPES, IDS, random_checkpoint, random_diffusion_gemma  # noqa: E402

CHECKPOINTS = {"tiny-llada": ["dual-cache:threshold=0.9", "dual-cache+focus:threshold=0.9",
                              "dual-cache+early-skip:threshold=0.9",
                              "dual-cache+adaptive-length+jump-share:threshold=0.9",
                              "dual-cache:threshold=0.9,commit_rule=credit"],
               "tiny-sdar": ["block:threshold=0.9", "block+focus:threshold=0.9",
                             "block:commit_rule=joint-threshold,preset=S"]}

# the widths of --tiny's DiffusionGemma models (the sampler's check and the engine's step cost)
TINY_DIFFUSION_GEMMA = dict(hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, global_head_dim=16, num_global_key_value_heads=1, num_experts=4,
                            top_k_experts=2, moe_intermediate_size=12)


def shapes(tiny: bool, layers: int) -> dict[str, tuple[ModelConfig, list[str]]]:
    """The step-cost models and the methods each runs (their real widths unless ``tiny``)."""
    if tiny:
        dense = dict(hidden_size=64, num_heads=4, num_kv_heads=4, intermediate_size=128, vocab_size=256)
        moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1)
        mini = dict(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=256,
                    rotary_dim=8, moe=moe)
    else:  # LLaDA-8B-Instruct's config.json; LLaDA2.0-mini's (shared/notes/llada2.md)
        dense = dict(hidden_size=4096, num_heads=32, num_kv_heads=32, intermediate_size=12288, vocab_size=126464)
        moe = MoEConfig(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, num_shared_experts=1,
                        n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=1)
        mini = dict(hidden_size=2048, num_heads=16, num_kv_heads=4, intermediate_size=5120, vocab_size=157184,
                    rotary_dim=64, moe=moe)
    llada = ModelConfig(model_type="llada", num_layers=layers, rope_theta=500000.0, rms_norm_eps=1e-5,
                        **dense, **IDS)
    llada2 = ModelConfig(model_type="llada2_moe", num_layers=layers, rope_theta=600000.0, rms_norm_eps=1e-6,
                         qk_norm=True, block_size=32, **mini, **IDS)
    return {"llada-8b-shaped": (llada, ["dual-cache:threshold=0.9", "dual-cache+focus:threshold=0.9",
                                        "dual-cache+early-skip:threshold=0.9"]),
            "llada2-mini-shaped": (llada2, ["block:threshold=0.9", "block+focus:threshold=0.9"])}


def correctness(device: str, tiny: bool) -> list[dict]:
    """Greedy tokens on ``device`` against the CPU, per checkpoint and method; a sampled
    request's agreement."""
    examples = load_split("worked", limit=1 if tiny else 4)
    rows = []
    for name, methods in CHECKPOINTS.items():
        methods = methods[:2] if tiny else methods  # tiny: the base decoder and one strategy
        here, cpu = LLM(ROOT / "checkpoints" / name, device=device), LLM(ROOT / "checkpoints" / name)
        defaults = {"max_new_tokens": 16 if tiny else 128}
        params = resolve_specs(methods, cpu.resolve, defaults)
        prompts = check_prompts(cpu, params, examples)
        sampled = {"temperature": 0.6, "seed": 7}
        for spec in methods:
            for label, p in (("greedy", params[spec]), ("sampled", params[spec].replace(**sampled))):
                start = time.perf_counter()
                got = here.generate(prompts, p, use_tqdm=False)
                seconds = time.perf_counter() - start
                want = cpu.generate(prompts, p, use_tqdm=False)
                same = [a.token_ids == b.token_ids for a, b in zip(got, want)]
                rows.append({"checkpoint": name, "method": spec, "draw": label, "prompts": len(prompts),
                             "rows_equal": sum(same), "equal": all(same), "seconds": round(seconds, 3)})
        here.close()
        cpu.close()
    return rows


def variants(device: str, tiny: bool = False) -> dict[str, dict]:
    """The weights and compilation each shaped model runs under beside plain bf16 (its base
    decoder only): torchao's int8 (and int4 on CUDA) weight-only quantization, and the
    compiled layers (``--compile``; not with ``tiny``: compiling takes longer than the rest of
    the check, and tests/test_compile.py covers that path)."""
    methods = ["int8", "int4"] if device.startswith("cuda") else ["int8"]
    if importlib.util.find_spec("torchao") is None:  # the rows say so by their absence; main prints why
        methods = []
    quantized = {q: {"quantization": q} for q in methods}
    return {"bf16": {}, **quantized, **({} if tiny else {"compiled": {"compile": True}})}


def fused_attention(device: str, tiny: bool) -> list[dict]:
    """Each checkpoint and method decodes with SDPA held to its fused kernels (flash,
    memory-efficient, cuDNN; the math fallback, which materialises every score, excluded): a
    mask or a grouped-query layout they cannot take raises, and the row says so."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    examples = load_split("worked", limit=1)
    rows = []
    for name, methods in CHECKPOINTS.items():
        methods = methods[:2] if tiny else methods
        llm = LLM(ROOT / "checkpoints" / name, device=device)
        params = resolve_specs(methods, llm.resolve, {"max_new_tokens": 16 if tiny else 64})
        prompts = check_prompts(llm, params, examples)
        for spec in methods:
            try:
                with sdpa_kernel(fused):
                    llm.generate(prompts, params[spec], use_tqdm=False)
                error = None
            except RuntimeError as e:
                error = (str(e).splitlines() or [type(e).__name__])[0][:200]
            rows.append({"checkpoint": name, "method": spec, "fused": error is None, "error": error})
        llm.close()
    return rows


def diffusion_gemma(device: str, tiny: bool) -> list[dict]:
    """DiffusionGemma's model and sampler (from Python, below the engine) on ``device``
    against the CPU: a random model of the released layer pattern (five sliding layers, then a
    full one; MoE beside a dense MLP), three left-padded prompts, seeded draws, the batch-invariant
    loop. Sampled tokens: a near-tie may flip one between devices, so the row counts them."""
    from dllm_engine.decoding.diffusion_gemma import GenerationSettings, SeededDraws, generate
    from dllm_engine.models.diffusion_gemma import FULL, SLIDING, DiffusionGemma, config_from_hf
    types = [SLIDING] * 5 + [FULL]
    text = dict(model_type="diffusion_gemma_text", num_hidden_layers=len(types), layer_types=types,
                max_position_embeddings=4096, **(
                    dict(vocab_size=96, sliding_window=4, **TINY_DIFFUSION_GEMMA) if tiny else
                    dict(vocab_size=32768, hidden_size=1024, intermediate_size=2048, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=128, global_head_dim=256, num_global_key_value_heads=2,
                         sliding_window=128, num_experts=32, top_k_experts=4, moe_intermediate_size=256)))
    canvas = 8 if tiny else 64
    cfg = config_from_hf({"model_type": "diffusion_gemma", "canvas_length": canvas, "text_config": text})
    torch.manual_seed(0)
    cpu = DiffusionGemma(cfg).eval()
    with torch.no_grad():
        for p in cpu.parameters():  # norms and scales around 1, matrices small: peaked, stable logits
            p.copy_(0.5 + torch.rand(p.shape) if p.dim() == 1 else 0.2 * torch.randn(p.shape))
    here = DiffusionGemma(cfg).eval()
    here.load_state_dict(cpu.state_dict())
    here.to(device)
    lengths = [5, 9, 7]
    prompt = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(prompt)
    for i, n in enumerate(lengths):  # left-padded
        prompt[i, -n:] = torch.randint(1, cfg.vocab_size, (n,))
        mask[i, -n:] = 1
    settings = GenerationSettings(max_new_tokens=2 * canvas, max_denoising_steps=8 if tiny else 32,
                                  eos_token_ids=(), pad_token_id=0)
    outs = {}
    for name, model in (("here", here), ("cpu", cpu)):
        dev = next(model.parameters()).device
        start = time.perf_counter()
        out = generate(model, prompt.to(dev), settings, SeededDraws([11, 12, 13]), attention_mask=mask.to(dev),
                       batch_invariant=True)
        outs[name] = (out, time.perf_counter() - start)
    (got, seconds), (want, _) = outs["here"], outs["cpu"]
    same = [torch.equal(a.cpu(), b) for a, b in zip(got.token_ids, want.token_ids)]
    return [{"model": f"random diffusion_gemma, {cfg.num_layers} layers, hidden {cfg.hidden_size}",
             "prompts": len(lengths), "rows_equal": sum(same), "equal": all(same), "seconds": round(seconds, 3),
             "denoising_steps": int(got.num_steps.sum())}]


def step_cost(device: str, tiny: bool, layers: int, batch_sizes: list[int], root: Path) -> list[dict]:
    """``dllm profile``'s records for the shaped random models on ``device``: every method in
    bf16, the base method under each other variant, with the weights' bytes and peak memory."""
    examples = load_split("worked", limit=1 if tiny else 4)
    rows = []
    for name, (config, methods) in shapes(tiny, layers).items():
        folder = random_checkpoint(config, root / name)
        for variant, options in variants(device, tiny).items():
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            llm = LLM(folder, device=device, dtype="bfloat16", **options)
            defaults = {"max_new_tokens": 16 if tiny else 128, "stop_at_eos": False}
            run = methods[:2] if tiny else methods  # tiny: the base decoder and FOCUS
            run = run if variant == "bf16" else run[:1]
            for record in run_profile(llm, run, batch_sizes, examples, defaults, progress=lambda line: None):
                rows.append({"model": name, "layers": config.num_layers, "variant": variant,
                             "weights_mb": round(weight_bytes(llm.model) / 2**20, 3), **asdict(record)})
            llm.close()
            if device.startswith("cuda"):
                rows[-1]["peak_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return rows


def diffusion_gemma_config(tiny: bool, layers: int = 2) -> dict:
    """config.json of the DiffusionGemma step-cost model: the release's widths (tests/
    test_diffusion_gemma.py's ``released_config``) with ``layers`` layers, the last one global;
    ``tiny``: ``diffusion-gemma-small``'s at toy widths, canvases of 8."""
    from dllm_engine.models.diffusion_gemma import FULL, SLIDING
    hf = json.loads(json.dumps(DIFFUSION_GEMMA_SHAPES["diffusion-gemma-small"]))  # a copy
    text = hf["text_config"]
    text["layer_types"] = [SLIDING] * (layers - 1) + [FULL]
    text["num_hidden_layers"] = layers
    if tiny:
        text.update(TINY_DIFFUSION_GEMMA)
        hf["canvas_length"] = 8
    else:
        text.update(vocab_size=262_144, hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704,
                    num_experts=128, top_k_experts=8, num_attention_heads=16, num_key_value_heads=8,
                    num_global_key_value_heads=2, head_dim=256, global_head_dim=512, rms_norm_eps=1e-6)
        hf["canvas_length"] = 256
    return hf


def diffusion_gemma_cost(device: str, tiny: bool, root: Path, layers: int = 2) -> list[dict]:
    """The canvas profile of a random DiffusionGemma of the release's widths on ``device``, in
    bfloat16, eager and compiled (not with ``tiny``), one canvas with the release's 48 denoising
    steps (tiny: 4), each batch size its own prompts (the held-out ones, repeated)."""
    hf = diffusion_gemma_config(tiny, layers)
    folder = random_diffusion_gemma(hf, root / "diffusion-gemma", torch.bfloat16)
    canvas = hf["canvas_length"]
    spec = f"diffusion-gemma:seed=0,stop_at_eos=false,steps={4 if tiny else 48}"
    examples = load_split("worked", limit=1 if tiny else 4)
    rows = []
    for variant, options in {"bf16": {}, **({} if tiny else {"compiled": {"compile": True}})}.items():
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        llm = LLM(folder, device=device, dtype="bfloat16", **options)
        prompts = [llm.check_ids(llm.apply_chat_template(e.chat())) for e in examples]
        for batch in [2] if tiny else [1, 32]:
            chosen = [prompts[i % len(prompts)] for i in range(batch)]
            record, = run_canvas_profile(llm, [spec], [batch], chosen, {"max_new_tokens": canvas},
                                         progress=lambda line: None)
            rows.append({"model": "diffusiongemma-26B-A4B-shaped", "layers": layers, "variant": variant,
                         "weights_mb": round(weight_bytes(llm.model) / 2**20, 3), **asdict(record),
                         "overhead": round(record.overhead, 4)})
        llm.close()
        if device.startswith("cuda"):
            rows[-1]["peak_memory_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return rows


def markdown(report: dict) -> str:
    """The report's tables."""
    lines = [f"*`scripts/gpu_check.py` on {report['device_name']}, commit {report['commit']}, {report['date']}; "
             f"torch {report['torch']}; command: `{report['command']}`*", "",
             "| checkpoint | method | draw | rows equal to the CPU's | seconds |", "|---|---|---|---|---|"]
    for r in report["correctness"]:
        lines.append(f"| {r['checkpoint']} | `{r['method']}` | {r['draw']} | {r['rows_equal']} / {r['prompts']} | "
                     f"{r['seconds']} |")
    lines += ["", "| model | prompts | sampled rows equal to the CPU's | denoising steps | seconds |", "|---|---|---|---|---|"]
    for r in report.get("diffusion_gemma", []):
        lines.append(f"| {r['model']} | {r['prompts']} | {r['rows_equal']} / {r['prompts']} | {r['denoising_steps']} | "
                     f"{r['seconds']} |")
    lines += ["", "| checkpoint | method | attention in fused kernels only |", "|---|---|---|"]
    for r in report["fused_attention"]:
        lines.append(f"| {r['checkpoint']} | `{r['method']}` | {'yes' if r['fused'] else 'no: ' + r['error']} |")
    lines += ["", "| model | weights | method | batch | step ms | forward ms | outside the forward | "
                  "host reads / step (in the layer loop) | ops outside the layer loop | tok/s | weights MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["step_cost"]:
        lines.append(f"| {r['model']} ({r['layers']} layers) | {r['variant']} | `{r['method']}` | {r['batch_size']} | "
                     f"{r['step_ms']} | {r['floor_ms']} | {r['overhead']:.1%} | {r['syncs_per_step']} "
                     f"({r['layer_syncs_per_step']}) | "
                     f"{r['ops_per_step']} | {r['throughput']} | {r['weights_mb']} |")
    lines += ["", "| model | weights | method | batch | ms per denoising step | in the forwards | outside | "
                  "host reads / step (in the forwards) | ops outside the forwards | tok/s | weights MB |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    if "diffusion_gemma_cost_error" in report:
        lines.append(f"| failed: {report['diffusion_gemma_cost_error']} | | | | | | | | | | |")
    for r in report.get("diffusion_gemma_cost", []):
        lines.append(f"| {r['model']} ({r['layers']} layers) | {r['variant']} | `{r['method']}` | {r['batch_size']} | "
                     f"{r['step_ms']} | {r['forward_ms']} | {r['overhead']:.1%} | "
                     f"{round(r['syncs_outside'] + r['syncs_inside'], 2)} ({r['syncs_inside']}) | {r['ops_outside']} | "
                     f"{r['tokens_per_second']} | {r['weights_mb']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: the check runs anywhere in seconds")
    p.add_argument("--layers", type=int, default=None, help="layers of the shaped models (default 4; tiny 2)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,64,128; tiny 2)")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --device cpu --tiny to check the script itself",
              file=sys.stderr)
        return 2
    layers = args.layers or (2 if args.tiny else 4)
    batch_sizes = [int(b) for b in (args.batch_sizes or ("2" if args.tiny else "1,64,128")).split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    report = {"device": args.device, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor()
              or "CPU", "torch": torch.__version__, "command": " ".join(["python scripts/gpu_check.py", *sys.argv[1:]]
                                                                            if argv is None else argv)}
    if importlib.util.find_spec("torchao") is None:
        print("gpu_check: torchao is not installed here: no int8 / int4 rows (pip install torchao)", file=sys.stderr)
    started = time.perf_counter()
    report["correctness"] = correctness(args.device, args.tiny)
    report["fused_attention"] = fused_attention(args.device, args.tiny)
    report["diffusion_gemma"] = diffusion_gemma(args.device, args.tiny)
    with tempfile.TemporaryDirectory() as tmp:
        report["step_cost"] = step_cost(args.device, args.tiny, layers, batch_sizes, Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        try:  # last, and on its own: a failure here (a 2.4B-parameter checkpoint on a small card) keeps the rest
            report["diffusion_gemma_cost"] = diffusion_gemma_cost(args.device, args.tiny, Path(tmp))
        except Exception as e:  # noqa: BLE001 -- reported in the JSON, the table and stderr
            report["diffusion_gemma_cost_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"gpu_check: DiffusionGemma's step cost failed: {report['diffusion_gemma_cost_error']}",
                  file=sys.stderr)
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    greedy_ok = all(r["equal"] for r in report["correctness"] if r["draw"] == "greedy")
    fused_ok = all(r["fused"] for r in report["fused_attention"])
    print(f"gpu_check: {'greedy tokens match the CPU' if greedy_ok else 'GREEDY TOKENS DIFFER FROM THE CPU'}; "
          f"{'attention runs in fused kernels' if fused_ok else 'ATTENTION FALLS BACK TO THE MATH KERNEL'}; "
          f"{report['seconds']} s; wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0 if greedy_ok and fused_ok else 1


if __name__ == "__main__":
    sys.exit(main())
