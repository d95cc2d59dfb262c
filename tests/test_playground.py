"""``dllm playground``: its handler driven through ``gradio_client`` against the launched app
(streamed canvases equal the trace, final text equals ``LLM.chat``'s / ``LLM.generate``'s, errors
shown in the page), the block family's defaults, and the timeline math."""
import os
import re
import socket
import sys

import pytest

from dllm_engine import LLM
from dllm_engine.cli import main
from dllm_engine.engine.trace import canvas_frames, record_from_dict, without_time
from dllm_engine.spec import parse_spec
from fixtures import write_checkpoint

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
CHECKPOINTS = __import__("pathlib").Path(__file__).resolve().parent.parent / "checkpoints"
MESSAGE = "sort : 3 1 2"
SLOT = re.compile(r'<span class="slot (mask|tok)([^"]*)" data-pos="(\d+)"(?: data-tok="(\d+)")?')
FAST = ":max_new_tokens=24,block_length=8,steps=8"  # one token a step: many steps to replay
WAIT_S = 300  # every wait on the app is bounded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llada():
    return LLM(CHECKPOINTS / "tiny-llada")


@pytest.fixture(scope="module")
def client(llada):
    pytest.importorskip("gradio", reason="the ui extra: pip install 'dllm-engine[ui]'")
    gradio_client = pytest.importorskip("gradio_client", reason="the test extra installs gradio_client")
    from dllm_engine.playground.app import build_app, launch
    demo = build_app(llada)
    url = launch(demo, port=free_port(), block=False)
    try:
        yield gradio_client.Client(url, verbose=False)
    finally:
        demo.close()


def send(client, spec_a: str, spec_b: str, replay: float = 0, chat: bool = True, message: str = MESSAGE):
    """Every output the Send handler streamed (a tuple of the seven components each)."""
    job = client.submit(message, spec_a, spec_b, replay, chat, None, api_name="/send")
    job.result(timeout=WAIT_S)
    return job.outputs()


def parse_pane(page: str) -> tuple[int, list[int | None], dict[int, str]]:
    """(the step shown, the answer slots' tokens, None where masked; slot -> its mark classes)."""
    step = int(re.search(r'data-step="(-?\d+)"', page).group(1))
    slots = [(int(pos), int(tok) if kind == "tok" else None, " ".join(set(marks.split()) - {"stop"}))
             for kind, marks, pos, tok in SLOT.findall(page)]
    return step, [tok for _, tok, _ in slots], {pos: marks for pos, _, marks in slots if marks}


def records(trace: dict):
    return [record_from_dict(d) for d in trace["steps"]]


def check_stream(outputs, pane: int, trace: dict) -> None:
    """Each streamed canvas of ``pane`` is the trace's canvas at the step it shows, the steps
    run -1, 0, 1, ... and the last output shows the finished canvas."""
    steps = records(trace)
    frames = canvas_frames(steps, trace["prompt_len"])
    shown = []
    for out in outputs:
        step, slots, _ = parse_pane(out[pane])
        shown.append(step)
        if step >= 0:
            assert slots == frames[step], f"pane {pane}, step {step}"
        else:
            assert slots and all(tok is None for tok in slots)
    assert shown == sorted(shown) and shown[0] == -1 and shown[-1] == len(steps) - 1
    assert set(shown) == set(range(-1, len(steps)))  # step by step: every step shown


@pytest.mark.parametrize("specs", [("dual-cache", "dual-cache+adaptive-length+jump-share"),
                                   ("dual-cache" + FAST, "dual-cache+jump-share" + FAST)])
def test_streamed_canvases_equal_the_trace_and_text_equals_chat(client, llada, specs):
    outputs = send(client, *specs)
    final = outputs[-1]
    for pane, (spec, text, trace) in enumerate(zip(specs, final[2:4], final[5:7])):
        want = llada.chat([{"role": "user", "content": MESSAGE}], parse_spec(spec).replace(record_steps=True))[0]
        assert text == want.text
        assert without_time(trace["steps"]) == without_time([r.as_dict() for r in want.steps])
        check_stream(outputs, pane, trace)
    assert "× the tok/s of pane A" in final[4] and 'data-done="true"' in final[0] and 'data-done="true"' in final[1]


def test_strategy_marks_are_the_trace_records(client):
    specs = ("dual-cache+focus" + FAST, "dual-cache+early-skip" + FAST)
    outputs = send(client, *specs)
    seen = {0: 0, 1: 0}
    for pane, key, css in ((0, "evicted", "ev"), (1, "skipped", "sk")):
        steps = records(outputs[-1][5 + pane])
        for out in outputs:
            step, _, marks = parse_pane(out[pane])
            if step < 0:
                continue
            if step == len(steps) - 1:
                assert not marks  # the finished canvas shows colours only
                continue
            rec = next(iter(steps[step].strategies.values()), {})
            want = {p if isinstance(p, int) else p[0] for p in rec.get(key, [])}
            assert {p for p, m in marks.items() if css in m.split()} == want
            seen[pane] += bool(want)
    assert seen[0] and seen[1], "no step evicted / skipped anything: the marks went untested"


def test_generate_without_chat_template_and_timed_replay(client, llada):
    specs = ("dual-cache" + FAST, "dual-cache+adaptive-length" + FAST)
    outputs = send(client, *specs, replay=1.0, chat=False)
    for pane, spec in enumerate(specs):
        assert outputs[-1][2 + pane] == llada.generate([MESSAGE], parse_spec(spec))[0].text
        shown = [parse_pane(out[pane])[0] for out in outputs]
        assert shown == sorted(shown) and shown[-1] == len(outputs[-1][5 + pane]["steps"]) - 1
    assert len(outputs) <= 1.0 * 30 + 2  # at most FPS frames a second of replay, plus first and last


@pytest.mark.parametrize("specs, message, error", [
    (("dual-cache", "dual-cache+foo"), MESSAGE, "Pane B: unknown strategy 'foo'"),
    (("block", "dual-cache"), MESSAGE, "Pane A: method 'block' cannot run"),
    (("dual-cache+jump-share:max_copies=3", "dual-cache"), MESSAGE, "Pane A: max_copies must be 1, 2, 4 or 8"),
    (("dual-cache", "dual-cache"), "   ", "type a message first"),
    (("dual-cache", "dual-cache:max_new_tokens=100000"), MESSAGE, "Pane B: "),
])
def test_errors_show_in_the_page(client, specs, message, error):
    outputs = send(client, *specs, message=message)
    assert len(outputs) == 1
    summary = outputs[0][4]
    assert summary.startswith("**Error.**") and error in summary and "Traceback" not in summary
    pane = {"A": 0, "B": 1}.get(error[5]) if error.startswith("Pane") else None
    if pane is not None:
        assert 'class="dllm-error"' in outputs[0][pane]


def test_block_family_panes_and_any_checkpoint_folder(tmp_path):
    pytest.importorskip("gradio", reason="the ui extra: pip install 'dllm-engine[ui]'")
    from dllm_engine.playground.app import Playground
    sdar = LLM(CHECKPOINTS / "tiny-sdar")
    pg = Playground(sdar)
    assert pg.methods == ("block", "block+focus")
    final = list(pg.send(MESSAGE, *pg.methods, replay_seconds=0))[-1]
    for spec, text in zip(pg.methods, final[2:4]):
        assert text == sdar.chat([{"role": "user", "content": MESSAGE}], parse_spec(spec))[0].text
    dream = LLM(write_checkpoint(tmp_path / "Dream", "Dream"))  # a folder without the embedded ones' names
    pg = Playground(dream)
    assert pg.methods == ("dual-cache", "dual-cache+adaptive-length+early-skip")
    final = list(pg.send(MESSAGE, *pg.methods, replay_seconds=0, chat=False))[-1]
    assert final[4].startswith("Pane B (`dual-cache+adaptive-length+early-skip`) ran at")
    assert final[2] == dream.generate([MESSAGE], parse_spec("dual-cache"))[0].text


def test_timeline_step_by_step_and_on_one_clock(llada):
    pytest.importorskip("gradio", reason="the ui extra: pip install 'dllm-engine[ui]'")
    from dllm_engine.playground.canvas import pane_params, run_pane, timeline
    runs = [run_pane(llada, s, pane_params(llada, s + FAST), MESSAGE, True) for s in ("dual-cache", "dual-cache")]
    runs[1].output.steps = runs[1].steps[:3]  # a shorter run
    frames = timeline(runs, 0)
    n = len(runs[0].steps)
    assert [at for at, _ in frames] == [[i, min(i, 2)] for i in range(-1, n)]
    assert all(wait == 0 for _, wait in frames)
    frames = timeline(runs, 2.0)
    assert frames[0][0] == [-1, -1] and frames[-1][0] == [n - 1, 2]
    assert sum(wait for _, wait in frames) == pytest.approx(2.0, abs=1 / 30 + 1e-6)


def test_cli_says_how_to_install_gradio(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gradio", None)  # import gradio raises ImportError
    assert main(["playground", "--port", "1"]) == 2
    assert "pip install 'dllm-engine[ui]'" in capsys.readouterr().err


def test_example_messages_from_a_prompts_file(tmp_path, monkeypatch, capsys):
    """--prompts: the page's examples are the file's messages (a conversation's last one); a bad
    file is one error line before the model loads."""
    from dllm_engine.cli import common
    from dllm_engine.playground.app import example_prompts
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "sort : 3 1 2"}\n'
                    '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}\n')
    assert example_prompts(good) == ["sort : 3 1 2", "hi"]
    assert example_prompts() and all(isinstance(p, str) and p for p in example_prompts())  # the task suite's
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    monkeypatch.setattr(common, "load_llm", lambda args: pytest.fail("the model loaded before the file was read"))
    assert main(["playground", "--prompts", str(bad), "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "line 2" in err
