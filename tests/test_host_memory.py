"""The glibc allocator tuning applied for CPU inference (engine/host_memory.py): process-wide, so
only on request (an ``LLM`` argument; the ``dllm`` commands ask for it unless told not to). Each
check runs in a fresh process: the setting cannot be undone, and this one must stay untuned."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import write_checkpoint

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")

# host_memory.py alone (not the package, whose imports allocate and free enough to move glibc's
# dynamic mmap threshold): a 24 MiB block made and freed, and the resident memory it leaves behind
EFFECT = """
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("host_memory", sys.argv[2])
host_memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_memory)
if sys.argv[1] == "on":
    assert host_memory.keep_freed_memory() and host_memory.is_kept()
else:
    assert not host_memory.is_kept()

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

before = rss()
block = b"\\x01" * (24 << 20)
during = rss()
del block
print(during - before, rss() - before)
"""

LLM_STATE = """
import sys
from dllm_engine import LLM
from dllm_engine.engine import host_memory
LLM(sys.argv[1])
print(host_memory.is_kept())
LLM(sys.argv[1], keep_freed_memory=True)
print(host_memory.is_kept())
"""


def run(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llada"), "llada")


@pytest.mark.parametrize("state", ["off", "on"])
def test_a_freed_block_stays_in_the_process_only_when_tuned(state):
    """Untuned, glibc maps a 24 MiB block on its own and unmaps it when freed; tuned (mmap
    threshold 32 MiB, trim threshold 1 GiB) the block comes from the heap and stays."""
    during, after = map(int, run(EFFECT, state, str(ROOT / "dllm_engine" / "engine" / "host_memory.py")).split())
    assert during >= 20 << 20  # the block was resident
    if state == "on":
        assert after >= 20 << 20
    else:
        assert after < 4 << 20


@pytest.mark.slow  # a subprocess loading a model twice
def test_a_library_llm_leaves_the_allocator_alone_unless_asked(ckpt):
    assert run(LLM_STATE, str(ckpt)).split() == ["False", "True"]


@pytest.mark.slow  # bench runs in subprocesses
@pytest.mark.parametrize("flag,state", [([], "on"), (["--no-keep-freed-memory"], "off")])
def test_the_cli_asks_for_it_and_the_bench_says_so(ckpt, tmp_path, flag, state):
    argv = ["bench", "--model", str(ckpt), "--methods", "dual-cache", "--batch-sizes", "1", "--tasks", "sort",
            "--limit", "1", "--max-new-tokens", "8", "--block-length", "8", "--out", str(tmp_path / "b"), *flag]
    out = run("import sys; from dllm_engine.cli import main; sys.exit(main(sys.argv[1:]))", *argv)
    assert f"keep_freed_memory: {state}" in out
