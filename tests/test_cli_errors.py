"""Every bad input to the ``dllm`` command is one ``error:`` line naming the problem, exit status
2, no traceback. Each case runs the real command in a subprocess; all of them start at once and
every wait is bounded."""
import json
import os
import socket
import subprocess
import sys

import pytest

from fixtures import write_checkpoint

pytestmark = pytest.mark.slow  # the dllm command in subprocesses and checkpoint loads per case

WAIT_S = 120


def corrupt(folder, kind):
    """Break a fresh checkpoint in one way; returns the path the command should name."""
    weights, config = folder / "model.safetensors", folder / "config.json"
    if kind == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
        return weights
    if kind == "empty weights":
        weights.write_bytes(b"")
        return weights
    cfg = json.loads(config.read_text())
    if kind == "config missing a key":
        del cfg["d_model"]
        config.write_text(json.dumps(cfg))
    elif kind == "config not an object":
        config.write_text(json.dumps([cfg]))
    elif kind == "config invalid JSON":
        config.write_text(json.dumps(cfg)[:-5])
    elif kind == "generation_config invalid JSON":
        (folder / "generation_config.json").write_text("{'max_new_tokens': 8}")
        return folder / "generation_config.json"
    return config


BROKEN = {  # kind -> (command, what the error line must say)
    "truncated weights": ("generate", "model.safetensors: not a readable safetensors file"),
    "empty weights": ("eval", "model.safetensors: not a readable safetensors file"),
    "config missing a key": ("bench", "config.json: missing key 'd_model'"),
    "config not an object": ("serve", "config.json: expected a JSON object of model settings, got a JSON list"),
    "config invalid JSON": ("generate", "config.json: invalid JSON at line 1"),
    "generation_config invalid JSON": ("generate", "generation_config.json: invalid JSON at line 1"),
}
BENCH = ["--methods", "dual-cache", "--out", "{tmp}/bench", "--limit", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cases(ckpt, tmp_path_factory) -> dict[str, tuple[list[str], str]]:
    """case id -> (dllm arguments, a text the one error line must contain)."""
    out, folders = {}, {}
    for kind, (command, message) in BROKEN.items():
        folder = folders[kind] = write_checkpoint(tmp_path_factory.mktemp(kind.replace(" ", "-")), "llada")
        named = corrupt(folder, kind)
        extra = [a.format(tmp=folder) for a in BENCH] if command == "bench" else []
        model = [str(folder), "--port", str(free_port())] if command == "serve" else ["--model", str(folder)]
        out[kind] = ([command, *model, *extra], f"{named.parent}/{message}")
    model, port = ["--model", str(ckpt)], str(free_port())
    out.update({
        "model is a file": (["generate", "--model", str(ckpt / "config.json")], "is a file"),
        "device tpu": (["generate", *model, "--device", "tpu"], "device 'tpu' is not a device name"),
        "device cuda on a CPU build": (["eval", *model, "--device", "cuda"], "device 'cuda' is not available"),
        "port out of range": (["serve", str(ckpt), "--port", "99999"], "--port 99999 is not a TCP port"),
        "temperature NaN": (["generate", *model, "--temperature", "nan"], "temperature must be a finite number"),
        "factor inf": (["generate", *model, "--factor", "inf"], "factor must be a finite number"),
        "serve a default it cannot run": (["serve", str(ckpt), "--method", "block", "--port", port],
                                          "method 'block' cannot run on this model"),
        "two models to serve": (["serve", str(ckpt), "--model", "/elsewhere"], "two models given"),
        # refused before any worker process starts
        "tensor parallel does not divide": (["generate", *model, "--tensor-parallel-size", "3"],
                                            "num_heads 4 is not divisible by tensor_parallel_size 3"),
        "profile under tensor parallel": (["profile", *model, "--methods", "dual-cache",
                                           "--tensor-parallel-size", "2"], "run it with --tensor-parallel-size 1"),
        "compile under tensor parallel": (["generate", *model, "--compile", "--tensor-parallel-size", "2"],
                                          "compile is for one process"),
        "bench compile under tensor parallel": (["bench", *model, "--methods", "dual-cache", "--compile",
                                                 "--tensor-parallel-size", "2", "--out", "unused"],
                                                "compile is for one process"),
        "compile step under tensor parallel": (["generate", *model, "--compile-step", "--tensor-parallel-size", "2"],
                                               "compile_step is for one process"),
        "profile a compiled step": (["profile", *model, "--methods", "dual-cache", "--compile-step"],
                                    "use --fixed-shapes here, and dllm bench --compile-step for its speed"),
        # refused before Ray starts, not in every replica
        "replicas under tensor parallel that does not divide": (
            ["serve", str(ckpt), "--replicas", "2", "--tensor-parallel-size", "3"],
            "num_heads 4 is not divisible by tensor_parallel_size 3"),
        "int4 on a CPU": (["generate", *model, "--quantization", "int4"], "int4 runs on CUDA only"),
        "a memory budget that is no size": (["generate", *model, "--kv-cache-memory", "lots"],
                                            "kv_cache_memory must be a number of bytes such as 2GiB"),
        "a request larger than the memory budget": (["generate", *model, "--kv-cache-memory", "64KiB"],
                                                    "more than the budget of 64.0 KiB (kv_cache_memory)"),
        # an output that cannot be written fails before the run, not after it
        "eval json into a missing folder": (["eval", *model, "--tasks", "sort", "--limit", "1", "--json",
                                             "/nonexistent-dllm/x.json"], "folder /nonexistent-dllm does not exist"),
        "eval samples into a missing folder": (["eval", *model, "--tasks", "sort", "--limit", "1", "--samples",
                                                "/nonexistent-dllm/x.jsonl"], "--samples /nonexistent-dllm/x.jsonl: folder"),
        "chain-probe json is a folder": (["chain-probe", *model, "--json", str(ckpt)], "is a folder; give a file name"),
        # the spec fails before the (broken) weights are read: specs are checked first
        "bench spec before weights": (["bench", "--model", str(folders["truncated weights"]), "--methods",
                                       "block", "--out", "unused"], "spec 'block': method 'block' cannot run"),
    })
    return out


@pytest.fixture(scope="module")
def argv_cases(tmp_path_factory):
    return cases(write_checkpoint(tmp_path_factory.mktemp("good"), "llada"), tmp_path_factory)


# one per kind of bad input (checkpoint, device, port, number) through the real entry point; a
# process each, so kept few: every case also runs in process below
SUBPROCESS_CASES = ["config not an object", "device tpu", "port out of range", "temperature NaN"]


@pytest.fixture(scope="module")
def results(argv_cases):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "dllm_engine.cli", *argv_cases[name][0]], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in SUBPROCESS_CASES}
    done = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done[name] = (proc.returncode, out, err)
    return done


def check_one_error_line(code: int, out: str, err: str, message: str) -> None:
    assert code == 2, (out, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    assert "serving" not in out  # nothing announced before the input was checked


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_is_one_error_line_and_exit_2(results, argv_cases, name):
    check_one_error_line(*results[name], argv_cases[name][1])


CASES = [*BROKEN, "model is a file", "device tpu", "device cuda on a CPU build", "port out of range",
         "temperature NaN", "factor inf", "serve a default it cannot run", "two models to serve",
         "bench spec before weights", "tensor parallel does not divide", "profile under tensor parallel",
         "replicas under tensor parallel that does not divide", "compile under tensor parallel",
         "bench compile under tensor parallel", "compile step under tensor parallel", "profile a compiled step",
         "eval json into a missing folder", "chain-probe json is a folder", "int4 on a CPU"]


@pytest.mark.parametrize("name", CASES)
def test_bad_input_in_process(argv_cases, capsys, name):
    from dllm_engine.cli import main
    argv, message = argv_cases[name]
    code = main(argv)
    check_one_error_line(code, *capsys.readouterr(), message)


@pytest.mark.parametrize("argv,message", [
    (["bench", "--model", "m", "--methods", "dual-cache", "--out", "o", "--batch-sizes", "0"],
     "argument --batch-sizes: expected comma-separated integers >= 1, got '0'"),
    (["bench", "--model", "m", "--methods", "dual-cache", "--out", "o", "--batch-sizes", ","],
     "argument --batch-sizes: expected comma-separated integers >= 1, got ','"),
    (["bench", "serve", "--url", "http://x", "--concurrency", "-1"], "expected comma-separated integers >= 1"),
    (["serve", "m", "--max-queue", "-1"], "argument --max-queue: expected an integer >= 0, got '-1'"),
    (["serve", "m", "--max-request-bytes", "big"],
     "argument --max-request-bytes: expected a byte count such as 8MiB or 500000, got 'big'"),
    (["bench", "--methods", "dual-cache", "--compare-quantization", "int3"],
     "argument --compare-quantization: expected comma-separated quantization methods (int8, int4), got 'int3'"),
])
def test_bad_numbers_are_refused_by_the_parser(capsys, argv, message):
    """Before anything loads or is announced: argparse's usage line and one error line, exit 2."""
    from dllm_engine.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and message in captured.err and captured.out == ""


def test_help_is_plain_text(capsys):
    """`dllm --help` and every command's help: no reST markup from the docstrings."""
    from dllm_engine.cli import all_commands, main
    for argv in (["--help"], *([name, "--help"] for name in all_commands())):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        out = capsys.readouterr().out
        assert exit_.value.code == 0 and "usage: dllm" in out and "``" not in out, (argv, out)


def test_version(capsys):
    from importlib.metadata import version
    from dllm_engine.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"dllm-engine {version('dllm-engine')}"


BUG = """
import sys
from dllm_engine.models import loader
def read_config(*args, **kwargs):
    raise ValueError("an internal invariant broke")
loader.read_config = read_config  # deep inside: the LLM reads its checkpoint's config through it
from dllm_engine.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_bug_keeps_its_traceback_and_exits_1(argv_cases):
    """A ValueError that is not a UserError is a bug, not bad input: the real entry point shows
    its traceback and exits 1 (a user error stays one line, exit 2: the cases above)."""
    argv = argv_cases["device tpu"][0][:3]  # generate --model GOOD
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", BUG, *argv], env=env, capture_output=True, text=True,
                          timeout=WAIT_S)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr and "ValueError: an internal invariant broke" in proc.stderr
    assert "error: an internal invariant broke" not in proc.stderr


def test_a_bug_propagates_from_main(argv_cases, monkeypatch, capsys):
    from dllm_engine.cli import main
    from dllm_engine.models import loader

    def read_config(*args, **kwargs):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(loader, "read_config", read_config)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(argv_cases["device tpu"][0][:3])
    assert "error:" not in capsys.readouterr().err
