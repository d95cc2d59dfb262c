"""Every ```python / ```bash block of README.md runs as written. A block that cannot run here
(a GPU, a server, minutes of benchmark) is preceded by ``<!-- readme-test: skip REASON -->`` with
REASON from ``REASONS`` (the README says so); it is reported as skipped, never dropped silently."""
import contextlib
import os
import signal
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the README's code blocks

ROOT = Path(__file__).resolve().parent.parent
REASONS = {"gpu": "needs a GPU and a real checkpoint", "server": "starts a server",
           "benchmark": "minutes of CPU", "training": "hours of CPU",
           "suite": "runs the test suite itself"}
FENCE = re.compile(r"(?:^<!-- readme-test: (?P<marker>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```",
                   re.M | re.S)
TIMEOUT_S = 300


@dataclass
class Block:
    line: int
    lang: str
    code: str
    marker: str | None

    @property
    def name(self) -> str:
        return f"{self.lang}-line-{self.line}"


def readme_blocks(text: str) -> list[Block]:
    return [Block(text.count("\n", 0, m.start("code")) + 1, m["lang"], m["code"], m["marker"])
            for m in FENCE.finditer(text) if m["lang"] in ("python", "bash")]


BLOCKS = readme_blocks((ROOT / "README.md").read_text())


def test_the_extractor_finds_blocks_and_markers():
    text = "x\n<!-- readme-test: skip gpu -->\n```bash\nnvidia-smi\n```\n```python\nprint(1)\n```\n```text\nz\n```\n"
    assert [(b.line, b.lang, b.code, b.marker) for b in readme_blocks(text)] == [
        (4, "bash", "nvidia-smi\n", "skip gpu"), (7, "python", "print(1)\n", None)]
    runnable = [b for b in BLOCKS if b.marker is None]
    assert {b.lang for b in runnable} == {"python", "bash"}, "the README has blocks of both kinds that run"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_readme_block_runs(block, tmp_path):
    if block.marker is not None:
        kind, _, reason = block.marker.partition(" ")
        assert kind == "skip" and reason in REASONS, f"unknown marker {block.marker!r}; use skip {set(REASONS)}"
        pytest.skip(f"README line {block.line}: {REASONS[reason]}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    command = [sys.executable, "-c", block.code] if block.lang == "python" else ["bash", "-e", "-c", block.code]
    # its own process group: whatever an unmarked block leaves running is ended with it
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"README line {block.line} failed:\n{out}\n{err}"
