"""lm-evaluation-harness: the ``dllm`` model, the embedded tasks as YAML, and the OpenAI route.

Runs offline: the tasks read the committed JSONL splits; the task manager indexes only them."""
import functools
import json
import logging
from pathlib import Path

import pytest
import torch
import yaml

lm_eval = pytest.importorskip("lm_eval")  # the lm-eval extra (make test installs it)

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from dllm_engine import LLM, SamplingParams  # noqa: E402
from dllm_engine.cli import main  # noqa: E402
from dllm_engine.eval import evaluate  # noqa: E402
from dllm_engine.integrations.lm_eval import DllmLM  # noqa: E402
from dllm_lab.lm_eval_tasks import GROUP, write_tasks  # noqa: E402
from dllm_lab.tasks import load_split  # noqa: E402
from fixtures import serving, write_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # lm-evaluation-harness runs and live servers

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
LIMIT = 2  # prompts per task


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    write_tasks(folder)
    return TaskManager(include_path=str(folder), include_defaults=False)


@pytest.fixture(scope="module")
def llada():
    return DllmLM(str(CHECKPOINTS / "tiny-llada"), method="dual-cache", threshold=0.9, batch_size=8)


def chat_context(lm, prompt: str) -> str:
    return lm.apply_chat_template([{"role": "user", "content": prompt}])


def request(kind: str, *args) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def run_suite(lm, task_manager, tasks=("dllm_copy",)) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=LIMIT, apply_chat_template=True,
                                   task_manager=task_manager, bootstrap_iters=0, log_samples=True)


def responses(results: dict) -> dict[str, list[str]]:
    """Each task's answers, in document order."""
    return {task: [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def test_simple_evaluate_equals_dllm_eval(llada, task_manager):
    results = run_suite(llada, task_manager)  # the family the shipped checkpoints learned
    report = evaluate(llada.llm, llada.params, tasks="copy", limit=LIMIT, batch_size=8, use_tqdm=False)
    for task, result in report.tasks.items():
        assert results["results"][f"dllm_{task}"]["exact_match,none"] == result.accuracy, task
    assert results["results"]["dllm_copy"]["exact_match,none"] == pytest.approx(report.accuracy)
    # the answers themselves are the engine's, token for token
    examples = load_split("copy", limit=LIMIT)
    outs = llada.llm.chat([[{"role": "user", "content": e.prompt}] for e in examples], llada.params)
    got = responses(results)
    for i, (ex, out) in enumerate(zip(examples, outs)):
        assert got[f"dllm_{ex.task}"][i % LIMIT] == out.text
    stats = llada.stats.as_dict()["generate_until"]
    assert stats["requests"] == len(examples) and stats["nfe"] == outs.stats.nfe


def test_worked_tasks_report_the_final_answer_grade_as_dllm_eval(llada, task_manager):
    results = run_suite(llada, task_manager, tasks=("dllm_worked",))
    report = evaluate(llada.llm, llada.params, tasks="worked", limit=LIMIT, batch_size=8, use_tqdm=False)
    for task, result in report.tasks.items():
        row = results["results"][f"dllm_{task}"]
        assert (row["exact_match,none"], row["final_answer,none"]) == (result.accuracy, result.final_accuracy), task
    group = results["results"]["dllm_worked"]
    assert group["final_answer,none"] == pytest.approx(report.final_accuracy)
    assert group["exact_match,none"] == pytest.approx(report.accuracy)


def test_tasks_follow_the_split_files(tmp_path):
    split = tmp_path / "split"
    split.mkdir()
    for name in ("sort", "zeta"):  # a family the code has never heard of gets its task too
        (split / f"{name}.jsonl").write_text('{"id": "x", "task": "sort", "prompt": "a", "answer": "b"}\n')
    assert write_tasks(tmp_path / "out", split) == ["dllm_sort", "dllm_zeta"]
    group = yaml.safe_load((tmp_path / "out" / f"{GROUP}.yaml").read_text())
    assert group["group"] == GROUP and group["task"] == ["dllm_sort", "dllm_zeta"]
    family = yaml.safe_load((tmp_path / "out" / "dllm_copy.yaml").read_text())
    assert family["task"] == ["dllm_sort"]  # families group the files they have
    assert not (tmp_path / "out" / "dllm_worked.yaml").exists()
    sort = (tmp_path / "out" / "dllm_sort.yaml").read_text()  # a copy task: no final answer to grade
    assert '"metric": "exact_match"' in sort and "final_answer" not in sort
    assert str((split / "zeta.jsonl").resolve()) in (tmp_path / "out" / "dllm_zeta.yaml").read_text()


def test_metrics_declared_are_the_ones_process_results_reports(tmp_path):
    """Each row is graded by its own ``task``, whatever the file's name: worked rows in a file that
    is no task's name declare ``final_answer`` (lm-eval otherwise reports it undeclared, with a
    warning and no direction), copy rows under a worked task's name do not, and the family group
    averages only what all its files declare."""
    from dllm_lab.lm_eval_tasks import process_results
    from dllm_lab.tasks.splits import DATA_DIR
    split = tmp_path / "split"
    split.mkdir()
    worked_row = (DATA_DIR / "test" / "sum.jsonl").read_text().splitlines()[0]
    copy_row = (DATA_DIR / "test" / "sort.jsonl").read_text().splitlines()[0]
    phrased_row = (DATA_DIR / "test" / "calc.jsonl").read_text().splitlines()[0]
    describe_row = (DATA_DIR / "test" / "describe.jsonl").read_text().splitlines()[0]
    files = {"mysum": worked_row, "add": copy_row, "insert": worked_row, "mycalc": phrased_row,
             "describe": describe_row}
    for stem, row in files.items():
        (split / f"{stem}.jsonl").write_text(row + "\n")
    write_tasks(tmp_path / "out", split)
    for stem, row in files.items():
        config = yaml.safe_load((tmp_path / "out" / f"dllm_{stem}.yaml").read_text()
                                .replace("!function", "#"))  # the hook's tag aside
        doc = json.loads(row)
        assert {m["metric"] for m in config["metric_list"]} == set(process_results(doc, [doc["answer"]])), stem
    assert process_results(json.loads(phrased_row), ["no trace"]) == {"exact_match": 0.0, "final_answer": 0.0,
                                                                       "form": 0.0}
    assert process_results(json.loads(describe_row), [json.loads(describe_row)["answer"]]) == {
        "exact_match": 1.0, "form": 1.0}  # open-ended: no final answer, a form
    group = yaml.safe_load((tmp_path / "out" / "dllm_worked.yaml").read_text())
    assert group["task"] == ["dllm_add", "dllm_insert"]
    assert [m["metric"] for m in group["aggregate_metric_list"]] == ["exact_match"]


def test_missing_split_folder_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .*jsonl split files in"):
        write_tasks(tmp_path / "out", tmp_path)


def test_batch_sizes_1_and_8_give_the_same_answers():
    sdar = str(CHECKPOINTS / "tiny-sdar")
    lms = [DllmLM(sdar, method="block+focus", threshold=0.9, batch_size=b) for b in (1, 8)]
    assert [lm.llm.engine.max_num_seqs for lm in lms] == [1, 8]
    reqs = [request("generate_until", chat_context(lms[0], e.prompt), {"until": []})
            for e in load_split("copy", limit=LIMIT)[:8]]
    one, eight = (lm.generate_until(reqs, disable_tqdm=True) for lm in lms)
    assert one == eight and all(one)


def test_until_cuts_each_request_at_its_own_stop_strings(llada):
    contexts = [chat_context(llada, e.prompt) for e in load_split(["sort", "reverse", "spell"], limit=1)]
    full = llada.generate_until([request("generate_until", c, {"until": []}) for c in contexts], True)
    words = [text.split() for text in full]
    stops = [[words[0][2]], ["not-in-any-answer", words[1][3], words[1][1]], words[2][4]]  # list / list / str
    got = llada.generate_until([request("generate_until", c, {"until": s}) for c, s in zip(contexts, stops)],
                               True)
    for text, stop, answer in zip(full, stops, got):
        stop = [stop] if isinstance(stop, str) else stop
        cut = min(text.find(s) for s in stop if s in text)
        assert answer == text[:cut]  # the stop string itself is left out, as lm-eval expects


def test_a_stop_string_ends_the_sequence_early():
    # stop_at_eos=False: the plain answer decodes its whole canvas, the stopped one ends at "5"
    llada = DllmLM(str(CHECKPOINTS / "tiny-llada"), method="dual-cache", threshold=0.9, stop_at_eos=False)
    context = chat_context(llada, load_split(["sort"], limit=1)[0].prompt)
    plain, stopped = llada.generation(context, {}), llada.generation(context, {"until": ["5"]})
    llada.run([plain, stopped])
    assert "5" in plain.text and stopped.text == plain.text[:plain.text.find("5")]
    # 128-token canvas, 4 blocks: the stop shows up in the first one, so the rest is never decoded
    assert stopped.seq.stats.nfe < plain.seq.stats.nfe
    assert 0 < stopped.seq.stats.output_tokens < plain.seq.stats.output_tokens


def test_max_gen_toks_is_per_request(llada):
    context = chat_context(llada, load_split(["spell"], limit=1)[0].prompt)
    short, default = llada.generate_until([request("generate_until", context, {"max_gen_toks": 5}),
                                           request("generate_until", context, {})], True)
    ids = llada.llm.encode(context)
    # 5 tokens need one 32-token block (dual-cache decodes whole blocks); the answer is cut to 5
    canvas = llada.llm.generate([ids], llada.params.replace(max_new_tokens=32))[0]
    assert short == llada.decode(canvas.token_ids[:5])
    assert default == llada.llm.generate([ids], llada.params)[0].text and len(default.split()) > 5


@pytest.mark.parametrize("name", ["tiny-llada", "tiny-sdar"])
def test_loglikelihood_ranks_the_right_answer_first(name):
    lm = DllmLM(str(CHECKPOINTS / name), mc_num=16, mc_batch=16, check_greedy=True)
    greedy = []
    for ex in load_split(["sort", "reverse"], limit=2):
        words = ex.answer.split()  # wrong answers of the same length: other orders of its words
        wrong = [" ".join(reversed(words)), " ".join(words[1:] + words[:1]), " ".join(words[-1:] + words[:-1])]
        assert ex.answer not in wrong
        context = chat_context(lm, ex.prompt)
        scores = lm.loglikelihood([request("loglikelihood", context, " " + c) for c in [ex.answer, *wrong]],
                                  disable_tqdm=True)
        values = [v for v, _ in scores]
        assert values.index(max(values)) == 0, (ex.prompt, values)
        assert not any(g for _, g in scores[1:])
        greedy.append(scores[0][1])
    # one token per step on an answer-sized canvas writes the answer (the copy-only tiny-llada of
    # commit ffd686a missed one sort)
    assert sum(greedy) >= 3
    assert lm.stats.loglikelihood_requests == 16 and lm.stats.loglikelihood_nfe == 16


def test_loglikelihood_is_deterministic_and_rolling_conditions_on_bos():
    lm = DllmLM(str(CHECKPOINTS / "tiny-llada"), mc_num=8, mc_batch=8)
    req = request("loglikelihood", "sort : 3 1 2", " 1 2 3")
    assert lm.loglikelihood([req], True) == lm.loglikelihood([req], True)
    text = "sort : 3 1 2 1 2 3"
    bos = lm.llm.tokenizer.bos_token_id
    assert lm.loglikelihood_rolling([request("loglikelihood_rolling", text)], True) == \
        [lm.score([bos], lm.llm.encode(text))]


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    return str(write_checkpoint(tmp_path_factory.mktemp("llada"), "llada"))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(thresold=0.9), r"unknown dllm model_args \['thresold'\]"),
    (dict(threshold="high"), "bad value 'high' for model_args threshold"),
    (dict(method="block"), "method 'block' cannot run on this model's attention pattern"),
    (dict(batch_size=0), "batch_size must be >= 1 or 'auto'"),
    (dict(mc_num=10, mc_batch=4), r"mc_num \(10\) must be a positive multiple of mc_batch"),
])
def test_bad_model_args(random_ckpt, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        DllmLM(random_ckpt, **kwargs)


def test_model_args_win_over_lm_eval_flags(random_ckpt):
    lm = DllmLM.create_from_arg_string(f"pretrained={random_ckpt},device=cpu,method=reference",
                                       {"device": "cuda:0", "batch_size": 4, "max_batch_size": None})
    assert str(lm.device) == "cpu" and lm.llm.engine.max_num_seqs == 4 and lm.params.method == "reference"


def test_lm_eval_s_default_device_falls_back_to_the_cpu(random_ckpt, dllm_warnings, monkeypatch):
    """lm-eval's --device defaults to cuda:0; without a GPU the model runs on the CPU, as lm-eval's
    HF model does, and says so once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lm = DllmLM.create_from_arg_string(f"pretrained={random_ckpt}", {"device": "cuda:0", "batch_size": 1})
    assert str(lm.device) == "cpu"
    warned, = dllm_warnings()
    assert warned.startswith("device 'cuda:0' is not available") and "running on the CPU" in warned
    with pytest.raises(ValueError, match="is not a device name"):
        DllmLM(random_ckpt, device="gpu0")


@pytest.fixture
def own_tasks_only(monkeypatch):
    """lm-eval's command line indexes its thousands of built-in tasks first (~20 s): only ours here."""
    monkeypatch.setattr("sys.argv", ["dllm"])
    monkeypatch.setattr("lm_eval.tasks.TaskManager", functools.partial(TaskManager, include_defaults=False))


def test_dllm_lm_eval_command(tmp_path, own_tasks_only):
    stats = tmp_path / "dllm_stats.json"
    args = f"pretrained={CHECKPOINTS / 'tiny-sdar'},method=block,threshold=0.9,stats_path={stats}"
    # no --device: lm-eval's cuda:0, the CPU on a machine without a GPU
    assert main(["lm-eval", "--model", "dllm", "--model_args", args, "--tasks", "dllm_sort", "--limit", "1",
                 "--apply_chat_template", "--output_path", str(tmp_path / "out")]) == 0
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert results["results"]["dllm_sort"]["exact_match,none"] == 1.0
    record = json.loads(stats.read_text())
    assert record["method"] == "block" and record["generate_until"]["requests"] == 1
    assert record["generate_until"]["nfe"] > 0


def test_dllm_lm_eval_reports_bad_model_args_in_one_line(own_tasks_only, capsys):
    args = f"pretrained={CHECKPOINTS / 'tiny-sdar'},thresold=0.9"
    assert main(["lm-eval", "--model", "dllm", "--model_args", args, "--tasks", "dllm_sort",
                 "--device", "cpu"]) == 2
    assert "error: unknown dllm model_args ['thresold']" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["local-completions", "local-chat-completions"])
def test_openai_route_gives_the_adapters_answers(llada, task_manager, model):
    """lm-eval's own OpenAI clients against ``dllm serve``, unchanged: same answers as ``dllm``."""
    tasks = ["dllm_sort", "dllm_count"]
    served = LLM(CHECKPOINTS / "tiny-llada")
    with serving(served, defaults=SamplingParams(method="dual-cache", threshold=0.9)) as (url, _):
        route = "chat/completions" if model == "local-chat-completions" else "completions"
        client = get_model(model)(base_url=f"{url}/v1/{route}", model="tiny", max_gen_toks=128,
                                  tokenizer=str(CHECKPOINTS / "tiny-llada"), num_concurrent=4, max_retries=1)
        over_http = responses(run_suite(client, task_manager, tasks))
    assert over_http == responses(run_suite(llada, task_manager, tasks))


def test_dllm_lm_eval_without_the_extra_says_how_to_install(monkeypatch, capsys):
    import sys

    import dllm_engine.integrations as integrations
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    monkeypatch.delitem(sys.modules, "dllm_engine.integrations.lm_eval")
    monkeypatch.delattr(integrations, "lm_eval")
    assert main(["lm-eval", "--model", "dllm"]) == 2
    assert "dllm lm-eval needs the lm-eval extra (pip install -e '.[lm-eval]')" in capsys.readouterr().err


# -- the audit of the lm-eval adapter against lm-eval's HF model ----------------------------------
LONG_TEXT = "sort : 3 1 2 " * 40  # 200 tokens


@pytest.fixture(scope="module")
def small_window(tmp_path_factory):
    """Random checkpoints whose context (max_position_embeddings) is ``window`` tokens."""
    made = {}

    def get(family: str, window: int) -> str:
        if (family, window) not in made:
            folder = tmp_path_factory.mktemp(f"{family}{window}")
            extra = {"block_size": 32} if family == "sdar" else {}
            made[family, window] = str(write_checkpoint(folder, family, max_position_embeddings=window,
                                                        **extra))
        return made[family, window]
    return get


@pytest.fixture
def dllm_warnings(caplog, monkeypatch):
    """The adapter's warnings (lm-eval's command line stops its logger propagating: undone here)."""
    monkeypatch.setattr(logging.getLogger("lm_eval"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="lm_eval.models.dllm")
    return lambda: [r.getMessage() for r in caplog.records
                    if r.name == "lm_eval.models.dllm" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_loglikelihood_keeps_the_end_of_a_context_longer_than_the_window(small_window, family,
                                                                           dllm_warnings):
    lm = DllmLM(small_window(family, 64), mc_num=4, mc_batch=4, check_greedy=True)
    prompt, target = lm.encode_pair(LONG_TEXT, " 1 2 3")
    assert len(prompt) > 64
    [(value, greedy)] = lm.loglikelihood([request("loglikelihood", LONG_TEXT, " 1 2 3")], True)
    assert value == lm.score(prompt[-(64 - len(target)):], target)  # as lm-eval's HF model: the last tokens
    # the greedy check fits its canvas too (it crashed): the decoded target is the argmax's or not
    assert greedy == lm.greedy([(prompt[-(64 - len(target)):], target)])[0]
    assert any("cut" in w for w in dllm_warnings())
    with pytest.raises(ValueError, match="continuation of 64 tokens does not fit"):
        lm.loglikelihood([request("loglikelihood", "sort", " " + "1 " * 63 + "2")], True)


@pytest.mark.parametrize("family,method,window,gen_kwargs,room", [
    ("llada", "dual-cache", 256, {"until": []}, 128),  # no max_gen_toks anywhere: the default 128
    ("sdar", "block", 64, {"until": [], "max_gen_toks": 5}, 32),  # one whole block after the prompt
    ("sdar", "block", 100, {"until": [], "max_gen_toks": 32}, 64),  # blocks aligned to 0: ends at 96
])
def test_generate_until_cuts_a_long_context_to_the_resolved_canvas(small_window, family, method, window,
                                                                  gen_kwargs, room):
    lm = DllmLM(small_window(family, window), method=method)
    gen = lm.generation(LONG_TEXT, gen_kwargs)
    ids = lm.llm.encode(LONG_TEXT)
    assert gen.seq.prompt_len == room and gen.seq.canvas[:room].tolist() == ids[-room:]
    assert gen.seq.canvas_len <= window
    [text] = lm.generate_until([request("generate_until", LONG_TEXT, gen_kwargs)], True)
    lm.run([gen])  # the same request on its own: the text is its decoded answer
    assert text == gen.text == lm.decode(gen.seq.output_ids()[: gen.max_tokens])


def test_sampled_repeats_get_distinct_seeds(random_ckpt):
    lm = DllmLM(random_ckpt)  # random weights: samples differ (the trained checkpoints are too sure)
    sample = {"until": [], "do_sample": True, "temperature": 1.0, "max_gen_toks": 8}
    repeated = [request("generate_until", "sort : 3 1 2", sample)] * 3  # lm-eval's repeats=3
    assert [lm.generation(*r.args, index=i).seq.params.seed for i, r in enumerate(repeated)] == [0, 1, 2]
    answers = lm.generate_until(repeated, True)
    assert len(set(answers)) == 3 and lm.generate_until(repeated, True) == answers  # reproducible
    greedy = [request("generate_until", "sort : 3 1 2", {"until": [], "max_gen_toks": 8})] * 2
    assert [lm.generation(*r.args, index=i).seq.params.seed for i, r in enumerate(greedy)] == [0, 0]


def test_gen_kwargs_are_normalized_as_lm_eval_does(llada, dllm_warnings):
    context = chat_context(llada, load_split(["spell"], limit=1)[0].prompt)

    def run(kwargs):
        return llada.generation(context, kwargs)
    assert run({"do_sample": False, "temperature": 0.7}).seq.params.temperature == 0.0  # greedy
    assert run({"temperature": 0.7}).seq.params.temperature == 0.7  # lm-eval: do_sample implied
    assert run({"do_sample": True}).seq.params.temperature == 1.0
    for alias in ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens"):
        gen = run({alias: 5})
        assert gen.max_tokens == 5 and gen.seq.params.max_new_tokens == 32, alias
    assert run({"max_gen_toks": 5, "max_tokens": 40}).max_tokens == 5  # lm-eval's priority
    assert not [w for w in dllm_warnings() if "ignores" in w]
    short = llada.generate_until([request("generate_until", context, {"max_new_tokens": 5})], True)
    assert short == llada.generate_until([request("generate_until", context, {"max_gen_toks": 5})], True)


def test_chat_template_continues_a_prefilled_answer(random_ckpt):
    lm = DllmLM(random_ckpt)
    prefilled = [{"role": "user", "content": "sort 3 1 2"}, {"role": "assistant", "content": "Answer:"}]
    assert lm.apply_chat_template(prefilled, add_generation_prompt=False).endswith("Answer:")
    assert lm.apply_chat_template(prefilled[:1]).endswith("assistant <|end_header_id|>")
    # a template without a system role: lm-eval's HF model drops the system message and retries
    lm.llm.tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                      "{{ raise_exception('no system role') }}{% endif %}"
                                      "[{{ m['role'] }}] {{ m['content'] }} {% endfor %}")
    with_system = [{"role": "system", "content": "be brief"}, *prefilled]
    assert lm.apply_chat_template(with_system, add_generation_prompt=False) == \
        "[user] sort 3 1 2 [assistant] Answer:"


def test_empty_inputs_as_lm_eval_s_hf_model(random_ckpt):
    lm = DllmLM(random_ckpt, mc_num=4, mc_batch=4)
    bos = lm.llm.tokenizer.bos_token_id
    assert lm.loglikelihood([request("loglikelihood", "sort : 3 1 2", "")], True) == [(0.0, True)]
    assert lm.loglikelihood_rolling([request("loglikelihood_rolling", "")], True) == [0.0]
    gen = lm.generation("", {"until": [], "max_gen_toks": 4})
    assert gen.seq.prompt_len == 1 and int(gen.seq.canvas[0]) == bos
    [text] = lm.generate_until([request("generate_until", "", {"max_gen_toks": 4})], True)
    lm.run([gen])  # the same request on its own: the text is its decoded answer
    assert text == gen.text == lm.decode(gen.seq.output_ids()[: gen.max_tokens])
    # no BOS token: the EOS token is the prefix, as lm-eval's prefix_token_id
    lm.llm.tokenizer.bos_token = None
    eos = lm.llm.tokenizer.eos_token_id
    assert lm.prefix_token_id == eos
    ids = lm.llm.encode("1 2 3")
    rolling = lm.loglikelihood_rolling([request("loglikelihood_rolling", "1 2 3")], True)
    assert rolling == [lm.score([eos], ids)]
    assert lm.loglikelihood([request("loglikelihood", "", "1 2 3")], True)[0][0] == lm.score([eos], ids)


def test_an_unchecked_is_greedy_warns_once_per_run(random_ckpt, dllm_warnings):
    lm = DllmLM(random_ckpt, mc_num=4, mc_batch=4)
    req = request("loglikelihood", "sort : 3 1 2", " 1 2 3")
    assert lm.loglikelihood([req], True)[0][1] is False and lm.loglikelihood([req], True)[0][1] is False
    assert len([w for w in dllm_warnings() if "check_greedy" in w]) == 1


def test_dllm_lm_eval_reports_not_implemented_in_one_line(own_tasks_only, monkeypatch, capsys):
    def unsupported(self, requests, disable_tqdm=False):
        raise NotImplementedError("no such request type here")
    monkeypatch.setattr(DllmLM, "generate_until", unsupported)
    args = f"pretrained={CHECKPOINTS / 'tiny-sdar'},method=block"
    assert main(["lm-eval", "--model", "dllm", "--model_args", args, "--tasks", "dllm_sort", "--limit", "1",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "error: no such request type here" in err and "Traceback" not in err
