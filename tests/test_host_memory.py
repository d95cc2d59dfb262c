"""The glibc allocator tuning applied for CPU inference (engine/host_memory.py): process-wide, so
only on request (an ``LLM`` argument; the ``dllm`` commands ask for it unless told not to)."""
import pytest

from dllm_engine import LLM
from dllm_engine.cli import main
from dllm_engine.engine import host_memory
from fixtures import write_checkpoint


@pytest.fixture()
def calls(monkeypatch):
    seen = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: seen.append(1) or True)
    monkeypatch.setattr(host_memory, "is_kept", lambda: bool(seen))
    return seen


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llada"), "llada")


def test_a_library_llm_leaves_the_allocator_alone(ckpt, calls):
    LLM(ckpt)
    assert calls == []
    LLM(ckpt, keep_freed_memory=True)
    assert calls == [1]


@pytest.mark.slow  # bench runs
@pytest.mark.parametrize("flag,state", [([], "on"), (["--no-keep-freed-memory"], "off")])
def test_the_cli_asks_for_it_and_the_bench_says_so(ckpt, calls, capsys, tmp_path, flag, state):
    argv = ["bench", "--model", str(ckpt), "--methods", "dual-cache", "--batch-sizes", "1", "--tasks", "sort",
            "--limit", "1", "--max-new-tokens", "8", "--block-length", "8", "--out", str(tmp_path), *flag]
    assert main(argv) == 0
    assert f"keep_freed_memory: {state}" in capsys.readouterr().out
    assert calls == ([1] if state == "on" else [])
