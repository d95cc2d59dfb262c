"""The two wheels are complete and apart: ``python -m build`` makes the engine's sdist and, from it,
its wheel, and the lab's wheel (``lab/``). The engine's wheel holds no trainer, task suite or probe.
Installed alone into a fresh venv, the engine generates from a given prompt and serves one
request from a folder that is not the checkout, and says what to do for a default prompt; with
the lab's wheel beside it, ``dllm generate`` (the default model and prompt) and ``dllm eval
--limit 2`` run as from a checkout.

Offline: a fresh venv gets the wheels alone (``--no-deps --no-index``); their dependencies come
from this interpreter's site-packages through a ``.pth`` line (a plain path: that folder's own
``.pth`` files, e.g. an editable install of this checkout, are not run), so nothing is downloaded
and the packages imported are the wheels' (checked)."""
import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run(cmd: list, cwd: Path, env: dict, timeout: int = 600) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> tuple[Path, Path]:
    """(the engine's wheel, the lab's), built without isolation from the checkout: the engine's
    from its sdist (what a release publishes), the lab's directly."""
    pytest.importorskip("build", reason="the test extra's `build` makes the wheels")
    tmp = tmp_path_factory.mktemp("wheels")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", ROOT], tmp, dict(os.environ))
    run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir", tmp / "dist", ROOT / "lab"], tmp,
        dict(os.environ))
    assert len(list((tmp / "dist").glob("*.tar.gz"))) == 1, "python -m build makes the engine's sdist"
    engine, = (tmp / "dist").glob("dllm_engine-*.whl")
    lab, = (tmp / "dist").glob("dllm_lab-*.whl")
    return engine, lab


def dependencies(tmp: Path) -> Path:
    """A folder of links to this interpreter's site-packages but the checkout's own packages (their
    editable installs and metadata): the venv sees the dependencies and only the wheels' dllm."""
    folder = tmp / "deps"
    folder.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().replace("-", "_").lstrip("_").removeprefix("editable__").startswith("dllm"):
            (folder / entry.name).symlink_to(entry)
    return folder


def where_imported(bin_dir: Path, work: Path, env: dict) -> dict[str, str]:
    """Where the venv's python finds each package ("None" when it does not)."""
    probe = ("import importlib.util as u\n"
             "for name in ('dllm_engine', 'dllm_lab'):\n"
             "    spec = u.find_spec(name)\n"
             "    print(name, spec.origin if spec else None)")
    return dict(line.split(" ", 1) for line in run([bin_dir / "python", "-c", probe], work, env).splitlines())


@pytest.fixture(scope="module")
def engine_only(wheels, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(its bin folder, a working folder outside the checkout, the environment) of a fresh venv
    with the engine's wheel alone. The tests below that ask for ``installed`` add the lab's wheel
    to this same venv (one venv, not two: the engine-only tests come first in this file)."""
    tmp = tmp_path_factory.mktemp("venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from the checkout
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    run([sys.executable, "-m", "venv", tmp / "venv"], tmp, env)
    bin_dir = tmp / "venv" / "bin"
    site = run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               tmp, env).strip()
    Path(site, "dllm-test-deps.pth").write_text(f"{dependencies(tmp)}\n")
    run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels[0]], tmp, env)
    work = tmp / "elsewhere"
    work.mkdir()
    where = where_imported(bin_dir, work, env)
    assert where["dllm_engine"].startswith(site), f"the wheel's engine is imported, not {where['dllm_engine']}"
    assert where["dllm_lab"] == "None", where
    return bin_dir, work, env


@pytest.fixture(scope="module")
def installed(engine_only, wheels) -> tuple[Path, Path, dict]:
    """The same venv with the lab's wheel installed too."""
    bin_dir, work, env = engine_only
    run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheels[1]], work, env)
    where = where_imported(bin_dir, work, env)
    assert "site-packages" in where["dllm_lab"] and str(ROOT) not in where["dllm_lab"], where
    return engine_only


def test_the_engine_wheel_holds_no_lab(wheels):
    engine, lab = (set(zipfile.ZipFile(w).namelist()) for w in wheels)
    code = {n for n in engine if n.endswith(".py")}
    assert "dllm_engine/engine/llm.py" in code and "dllm_engine/tokenizer.py" in code
    assert not any(n.startswith("dllm_lab/") or "/tasks/" in n or "train" in n.split("/")[-1] or "probe" in n
                   for n in engine), sorted(n for n in engine if "lab" in n or "task" in n or "probe" in n)
    assert {"dllm_lab/train/trainer.py", "dllm_lab/tasks/splits.py", "dllm_lab/probes/chain_probe.py",
            "dllm_lab/tasks/data/test/story.jsonl"} <= lab
    assert any(n.startswith("dllm_engine/checkpoints/tiny-llada/") for n in engine)  # checkpoints, not lab code
    assert not any(n.startswith("dllm_engine/") for n in lab)


def test_the_engine_alone_generates_and_asks_for_a_prompt(engine_only):
    bin_dir, work, env = engine_only
    out = run([bin_dir / "dllm", "generate", "--threads", "1", "--prompt", "sort : 9 2 7 4"], work, env)
    assert "output: 2 4 7 9" in out, out
    proc = subprocess.run([bin_dir / "dllm", "generate", "--threads", "1"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "give a prompt: --prompt TEXT (no dataset named 'tasks'" in proc.stderr, proc.stderr
    assert "pip install dllm-lab" in proc.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dllm serve exited:\n{proc.communicate()[0]}"
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"dllm serve did not answer {url} within {seconds} s")


def test_the_engine_alone_serves_one_request(engine_only):
    bin_dir, work, env = engine_only
    port = free_port()
    proc = subprocess.Popen([bin_dir / "dllm", "serve", "--port", str(port), "--threads", "1"], cwd=work,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", proc)
        body = json.dumps({"messages": [{"role": "user", "content": "sort : 9 2 7 4"}], "max_tokens": 32})
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert answer["choices"][0]["message"]["content"].strip() == "2 4 7 9", answer


def test_generate_runs_the_packaged_default_model(installed):
    bin_dir, work, env = installed
    out = run([bin_dir / "dllm", "generate", "--threads", "1"], work, env)
    model = next(line for line in out.splitlines() if line.startswith("model: "))
    assert "site-packages" in model and str(ROOT) not in model, model
    assert "(correct)" in out, out


def test_eval_runs_on_the_packaged_splits(installed):
    bin_dir, work, env = installed
    out = run([bin_dir / "dllm", "eval", "--tasks", "sort,story", "--limit", "2", "--threads", "1"], work, env)
    assert "mean " in out and "tok/s" in out, out
