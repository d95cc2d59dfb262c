"""The wheel is complete: ``python -m build`` makes an sdist and, from it, a wheel; installed into a
fresh venv, ``dllm generate`` (the default model), ``dllm eval --limit 2`` and ``dllm serve`` + one
request work from a folder that is not the checkout.

Offline: the fresh venv gets the wheel alone (``--no-deps --no-index``); its dependencies come
from this interpreter's site-packages through a ``.pth`` line (a plain path: that folder's own
``.pth`` files, e.g. an editable install of this checkout, are not run), so nothing is downloaded
and the package imported is the wheel's (checked)."""
import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
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
def installed(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the fresh venv's bin folder, a working folder outside the checkout, the environment)."""
    pytest.importorskip("build", reason="the test extra's `build` makes the wheel")
    tmp = tmp_path_factory.mktemp("wheel")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", ROOT], tmp, dict(os.environ))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from the checkout
    env.update(OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    assert len(list((tmp / "dist").glob("*.tar.gz"))) == 1, "python -m build makes an sdist"
    wheel, = (tmp / "dist").glob("*.whl")
    run([sys.executable, "-m", "venv", tmp / "venv"], tmp, env)
    bin_dir = tmp / "venv" / "bin"
    site = run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               tmp, env).strip()
    Path(site, "dllm-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], tmp, env)
    work = tmp / "elsewhere"
    work.mkdir()
    where = run([bin_dir / "python", "-c", "import dllm_engine; print(dllm_engine.__file__)"], work, env)
    assert where.startswith(site), f"the wheel's package is imported, not {where}"
    return bin_dir, work, env


def test_generate_runs_the_packaged_default_model(installed):
    bin_dir, work, env = installed
    out = run([bin_dir / "dllm", "generate", "--threads", "1"], work, env)
    model = next(line for line in out.splitlines() if line.startswith("model: "))
    assert "site-packages" in model and str(ROOT) not in model, model
    assert "(correct)" in out, out


def test_eval_runs_on_the_packaged_splits(installed):
    bin_dir, work, env = installed
    out = run([bin_dir / "dllm", "eval", "--limit", "2", "--threads", "1"], work, env)
    assert "mean " in out and "tok/s" in out, out


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


def test_serve_answers_one_request(installed):
    bin_dir, work, env = installed
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
