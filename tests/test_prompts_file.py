"""``--prompts FILE.jsonl`` of `dllm bench`, `dllm bench serve` and `dllm profile`: a file's
prompts go where the task split's go, graded by exact match when every line has an answer and not
graded (accuracy null / "–") when none has; every bad file is one ``error:`` line, exit 2."""
import json
from pathlib import Path

import httpx
import pytest

from dllm_engine.bench.prompts import load_prompts
from dllm_engine.cli import main
from dllm_engine.errors import UserError

TINY_LLADA = Path(__file__).resolve().parent.parent / "checkpoints" / "tiny-llada"
RUN = ["--model", str(TINY_LLADA), "--methods", "dual-cache:threshold=0.9", "--max-new-tokens", "16",
       "--threads", "1"]
# what the embedded tiny-llada answers (dllm generate --chat --prompt "sort : 9 4 7 1": "1 4 7 9"):
# lines 1 and 3 right (3: the same question as a conversation, its answer padded with spaces), line 2
# given a wrong answer, line 4 a question it was never trained on
GRADED = [{"prompt": "sort : 9 4 7 1", "answer": "1 4 7 9", "id": "sorted"},
          {"prompt": "sort : 9 4 7 1", "answer": "9 7 4 1"},
          {"messages": [{"role": "user", "content": "sort : 9 4 7 1"}], "answer": " 1 4 7 9 "},
          {"prompt": "what is the capital of france ?", "answer": "paris"}]
PLAIN = [{"prompt": "sort : 9 4 7 1"},
         {"messages": [{"role": "system", "content": "sort the digits"}, {"role": "user", "content": "sort : 5 2 8"}]}]


def write_jsonl(path: Path, rows: list, blank_line: bool = False) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines[:1] + [""] * blank_line + lines[1:]) + "\n", encoding="utf-8")
    return path


# -- the loader --------------------------------------------------------------------------------
def test_load_prompts_reads_prompts_conversations_answers_and_ids(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", GRADED, blank_line=True)
    rows = load_prompts(path)
    assert [r.id for r in rows] == ["sorted", "mine.jsonl:3", "mine.jsonl:4", "mine.jsonl:5"]  # line 2 blank
    assert {r.task for r in rows} == {"mine.jsonl"}
    assert [r.where for r in rows][:2] == [f"{path}, line 1", f"{path}, line 3"]
    assert rows[0].chat() == [{"role": "user", "content": "sort : 9 4 7 1"}]
    assert rows[2].chat() == rows[0].chat() and rows[2].messages is not None
    assert rows[0].grades("  1 4 7 9\n") == (True, None, None)  # the output stripped
    assert rows[2].grades("1 4 7 9") == (True, None, None)  # the answer stripped too
    assert rows[1].grades("1 4 7 9") == (False, None, None)
    assert rows[0].grades("1 4 7 9 9") == (False, None, None)  # exact, not a prefix
    assert [r.id for r in load_prompts(path, limit=2)] == ["sorted", "mine.jsonl:3"]  # the first N lines

    plain = load_prompts(write_jsonl(tmp_path / "plain.jsonl", PLAIN))
    assert [r.answer for r in plain] == [None, None]
    assert plain[0].grades("anything") == (None, None, None)  # nothing to grade
    assert plain[1].chat() == PLAIN[1]["messages"] and plain[1].prompt == "sort the digits\nsort : 5 2 8"


def test_a_task_split_file_reads_as_it_is():
    """Fields beyond prompt / answer / id (a split's ``task``) are ignored."""
    split = Path(__file__).resolve().parent.parent / "lab" / "dllm_lab" / "tasks" / "data" / "test" / "sort.jsonl"
    rows = load_prompts(split, limit=3)
    first = json.loads(split.read_text().splitlines()[0])
    assert len(rows) == 3 and (rows[0].prompt, rows[0].answer, rows[0].id) == (first["prompt"], first["answer"], first["id"])
    assert rows[0].grades(first["answer"])[0] is True


BAD_FILES = [
    (None, "prompts file {path} does not exist"),
    ("", "prompts file {path} holds no prompts"),
    ("\n  \n", "prompts file {path} holds no prompts"),
    ('{"prompt": "a"}\n{"prompt": "b"\n', "{path}, line 2: not JSON (Expecting ',' delimiter at column 15)"),
    ('["sort : 1 2"]\n', "{path}, line 1: an array, not a JSON object"),
    ('"sort : 1 2"\n', "{path}, line 1: a string, not a JSON object"),
    ('{"prompt": "a"}\n{"answer": "b"}\n', '{path}, line 2: give one of "prompt" (a string) and "messages"'),
    ('{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}\n', '{path}, line 1: give one of "prompt"'),
    ('{"prompt": 3}\n', '{path}, line 1: "prompt" must be a non-empty string, got 3'),
    ('{"prompt": "  "}\n', '{path}, line 1: "prompt" must be a non-empty string'),
    ('{"messages": []}\n', '{path}, line 1: "messages" must be a non-empty list'),
    ('{"messages": [{"role": "user", "content": 5}]}\n', '{path}, line 1: message 0 must be an object with a "role"'),
    ('{"prompt": "a", "answer": 7}\n', '{path}, line 1: "answer" must be a string, got 7'),
    ('{"prompt": "a", "answer": "x"}\n{"prompt": "b", "answer": "y"}\n{"prompt": "c"}\n',
     'prompts file {path} mixes lines with an "answer" (line 1) and without (line 3): give every line an answer'),
]


BAD_NAMES = ["missing file", "empty file", "blank lines only", "not JSON", "an array", "a string", "no prompt",
             "prompt and messages", "prompt not a string", "blank prompt", "empty messages",
             "message content not a string", "answer not a string", "answers mixed"]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=BAD_NAMES)
def test_every_bad_file_is_one_error_line_and_exit_2_before_the_model_loads(tmp_path, capsys, monkeypatch, text,
                                                                           message):
    from dllm_engine.cli import common
    monkeypatch.setattr(common, "load_llm", lambda *_, **__: pytest.fail("loaded the model"))
    path = tmp_path / "bad.jsonl"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    want = message.format(path=path)
    with pytest.raises(UserError) as error:
        load_prompts(path)
    assert str(error.value).startswith(want), str(error.value)
    for command in (["bench", *RUN, "--out", str(tmp_path / "out")], ["profile", *RUN],
                    ["bench", "serve", "--url", "http://127.0.0.1:9"]):  # nothing listens: the file fails first
        assert main([*command, "--prompts", str(path)]) == 2, command
        err = capsys.readouterr().err
        assert err.startswith(f"error: {want}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()  # refused before the bench's output folder is made


def test_limit_below_one_is_refused(tmp_path, capsys):
    path = write_jsonl(tmp_path / "p.jsonl", PLAIN)
    with pytest.raises(UserError, match="limit must be >= 1 or None, got 0"):
        load_prompts(path, limit=0)
    assert main(["profile", *RUN, "--prompts", str(path), "--limit", "0"]) == 2
    assert capsys.readouterr().err == "error: limit must be >= 1 or None, got 0\n"


@pytest.mark.parametrize("command", [["bench", *RUN], ["profile", *RUN], ["bench", "serve"]])
def test_tasks_and_prompts_are_exclusive(tmp_path, capsys, command):
    path = write_jsonl(tmp_path / "p.jsonl", PLAIN)
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--tasks", "sort", "--prompts", str(path)])
    assert exit_.value.code == 2
    assert "argument --prompts: not allowed with argument --tasks" in capsys.readouterr().err


# -- dllm bench and the evaluation under it ---------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llada():
    from dllm_engine import LLM
    return LLM(str(TINY_LLADA))


def test_evaluate_grades_each_line_by_exact_match(tmp_path, tiny_llada):
    from dllm_engine.eval import evaluate
    from dllm_engine.spec import parse_spec
    examples = load_prompts(write_jsonl(tmp_path / "graded.jsonl", GRADED))
    samples = tmp_path / "samples.jsonl"
    report = evaluate(tiny_llada, parse_spec("dual-cache:threshold=0.9", max_new_tokens=16), examples=examples,
                      batch_size=4, use_tqdm=False, samples=samples)
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    outputs = [r["output"] for r in records]
    assert outputs[0] == outputs[1] == outputs[2] == "1 4 7 9"  # a conversation line = its prompt as one message
    assert [r["correct"] for r in records] == [True, False, True, False]
    assert [r["id"] for r in records][:2] == ["sorted", "graded.jsonl:2"] and records[1]["target"] == "9 7 4 1"
    assert report.accuracy == 0.5 and report.as_dict()["accuracy"] == 0.5
    assert report.final_accuracy is None and report.form_accuracy is None


def test_evaluate_without_answers_has_no_accuracy(tmp_path, tiny_llada):
    from dllm_engine.eval import evaluate
    from dllm_engine.spec import parse_spec
    examples = load_prompts(write_jsonl(tmp_path / "plain.jsonl", PLAIN))
    report = evaluate(tiny_llada, parse_spec("dual-cache:threshold=0.9", max_new_tokens=16), examples=examples,
                      use_tqdm=False)
    assert report.accuracy is None and report.as_dict()["accuracy"] is None
    assert report.as_dict()["tasks"][0]["accuracy"] is None and report.stats.output_tokens > 0
    row, mean = report.table().splitlines()[1:3]
    assert row.split()[:3] == ["plain.jsonl", "2", "–"] and mean.split()[:3] == ["mean", "2", "–"]


def test_bench_with_answers_reports_their_exact_match_accuracy(tmp_path, capsys):
    path = write_jsonl(tmp_path / "graded.jsonl", GRADED)
    out = tmp_path / "out"
    assert main(["bench", *RUN, "--prompts", str(path), "--batch-sizes", "1,4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"prompts: 4  prompts file: {path}  " in printed
    rows = json.loads((out / "results.json").read_text())
    assert [(r["batch_size"], r["num_prompts"], r["accuracy"]) for r in rows] == [(1, 4, 0.5), (4, 4, 0.5)]
    assert rows[0]["tasks"] == ["graded.jsonl"]
    assert "| `dual-cache:threshold=0.9` | 1 | 50.0% |" in (out / "table.md").read_text()
    # --limit takes the first lines of the file
    assert main(["bench", *RUN, "--prompts", str(path), "--limit", "2", "--batch-sizes", "1", "--out", str(out)]) == 0
    assert [(r["num_prompts"], r["accuracy"]) for r in json.loads((out / "results.json").read_text())] == [(2, 0.5)]


def test_bench_without_answers_reports_no_accuracy_anywhere(tmp_path, capsys):
    path = write_jsonl(tmp_path / "plain.jsonl", PLAIN)
    out = tmp_path / "out"
    assert main(["bench", *RUN, "--prompts", str(path), "--batch-sizes", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("dual-cache:threshold=0.9 "))
    assert row.split()[1:3] == ["1", "–"], row  # the progress row: batch, accuracy
    data = json.loads((out / "results.json").read_text())
    assert data[0]["accuracy"] is None and data[0]["num_prompts"] == 2 and data[0]["output_tokens"] > 0
    assert "| `dual-cache:threshold=0.9` | 1 | – |" in (out / "table.md").read_text()
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["report", str(out)]) == 0  # dllm report renders the run from its JSON
    assert "| `dual-cache:threshold=0.9` | 1 | – |" in capsys.readouterr().out


def test_profile_takes_the_prompts_file(tmp_path, capsys):
    path = write_jsonl(tmp_path / "graded.jsonl", GRADED)
    assert main(["profile", *RUN, "--prompts", str(path), "--batch-sizes", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"prompts: 4  prompts file: {path}  " in printed  # every line: --limit's default 2 is per task
    assert "| `dual-cache:threshold=0.9` | 2 |" in printed
    assert main(["profile", *RUN, "--prompts", str(path), "--batch-sizes", "1", "--limit", "1"]) == 0
    assert f"prompts: 1  prompts file: {path}  " in capsys.readouterr().out


# -- dllm bench serve, against a stand-in server ------------------------------------------------
class StandIn:
    """An OpenAI-style streamed chat endpoint (httpx.MockTransport) that answers the sorted digits
    of the last user message, and records the conversations it was sent."""

    def __init__(self) -> None:
        self.conversations: list[list[dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text="dllm_resident_memory_bytes 1048576\n")
        messages = json.loads(request.content)["messages"]
        self.conversations.append(messages)
        answer = " ".join(sorted(messages[-1]["content"].split(":")[-1].split()))
        chunks = [{"choices": [{"index": 0, "delta": {"content": answer}}]},
                  {"choices": [], "usage": {"completion_tokens": len(answer.split()), "nfe": 1}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})


@pytest.fixture
def stand_in(monkeypatch):
    from dllm_engine.bench import serve
    server, client = StandIn(), httpx.AsyncClient
    monkeypatch.setattr(serve, "served_model", lambda url, timeout: "stand-in")
    monkeypatch.setattr(serve.httpx, "AsyncClient",
                        lambda **kw: client(transport=httpx.MockTransport(server), **kw))
    return server


def test_bench_serve_sends_the_files_conversations_and_grades_them(tmp_path, capsys, stand_in):
    rows = [{"prompt": "sort : 9 4 7 1", "answer": "1 4 7 9"},  # the stand-in answers right
            {"prompt": "sort : 3 1 2", "answer": "3 2 1"},  # ... and a wrong answer given
            {"messages": [{"role": "system", "content": "sort"}, {"role": "user", "content": "sort : 5 2"}],
             "answer": "2 5"}]
    out = tmp_path / "serve"
    assert main(["bench", "serve", "--url", "http://stand-in", "--concurrency", "1", "--num-requests", "3",
                 "--prompts", str(write_jsonl(tmp_path / "graded.jsonl", rows)), "--out", str(out)]) == 0
    assert "prompts file: " in capsys.readouterr().out
    level, = json.loads((out / "serve_bench.json").read_text())["levels"]
    assert (level["num_requests"], level["failures"], level["accuracy"]) == (3, 0, round(2 / 3, 4))
    assert stand_in.conversations == [[{"role": "user", "content": "sort : 9 4 7 1"}],
                                      [{"role": "user", "content": "sort : 3 1 2"}], rows[2]["messages"]]
    assert "| 66.7% |" in (out / "table.md").read_text()


def test_bench_serve_without_answers_has_no_accuracy(tmp_path, capsys, stand_in):
    out = tmp_path / "serve"
    assert main(["bench", "serve", "--url", "http://stand-in", "--concurrency", "1,2", "--num-requests", "4",
                 "--prompts", str(write_jsonl(tmp_path / "plain.jsonl", PLAIN)), "--limit", "1",
                 "--shared-prefix", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    levels = json.loads((out / "serve_bench.json").read_text())["levels"]
    assert [(r["num_requests"], r["failures"], r["accuracy"]) for r in levels] == [(4, 0, None), (4, 0, None)]
    # --limit 1: only the first line is sent; --shared-prefix: its words start the message
    assert {m[0]["content"] for m in stand_in.conversations} == {"sort :\nsort : 9 4 7 1"}
    assert "| – | 1 |" in (out / "table.md").read_text()  # accuracy, then the peak memory (MB)
    rows = [line.split() for line in printed.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert [(r[0], r[10]) for r in rows] == [("1", "–"), ("2", "–")], printed  # concurrency, accuracy


def test_a_level_with_nothing_graded_reports_no_accuracy():
    from dllm_engine.bench.serve import RequestRecord, format_row, summarize
    graded = summarize([RequestRecord(True, 0.1, 0.05, 4, correct=1, choices=2)], 1, 1.0)
    assert graded.accuracy == 0.5
    ungraded = summarize([RequestRecord(True, 0.1, 0.05, 4, correct=0, choices=0)], 1, 1.0)
    assert ungraded.accuracy is None and format_row(ungraded).split()[10] == "–"
