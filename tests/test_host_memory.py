"""The glibc allocator tuning applied for CPU inference (engine/host_memory.py)."""
import platform
import subprocess
import sys

import pytest

CHECK = "from dllm_engine.engine.host_memory import keep_freed_memory as k; print(k(), k())"


def run(env_value: str | None) -> str:
    env = {"PATH": "/usr/bin:/bin"} | ({"DLLM_KEEP_FREED_MEMORY": env_value} if env_value else {})
    return subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning is glibc-only")
def test_applied_once_and_idempotent():
    assert run(None) == "True True"


def test_opt_out_leaves_the_allocator_alone():
    assert run("0") == "False False"
