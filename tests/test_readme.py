"""Every ```python / ```bash block of README.md and docs/**/*.md runs as written, from the
repository root. A block that cannot run here (a GPU, the network, a server, minutes of benchmark)
is preceded by ``<!-- readme-test: skip REASON -->`` with REASON from ``REASONS``
(docs/development.md says so); it is reported as skipped, never dropped silently. A block whose
output shows a right answer is preceded by ``<!-- readme-test: expect TEXT -->`` and must print
TEXT. Every block that runs must print something.

Also checked here: relative links point at files that exist, the README stays a product page, and
benchmark pages hold generated sections only."""
import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the README's code blocks

ROOT = Path(__file__).resolve().parent.parent
REASONS = {"gpu": "needs a GPU and a real checkpoint", "network": "downloads from the Hugging Face Hub",
           "server": "starts a server", "benchmark": "minutes of CPU", "training": "hours of CPU",
           "suite": "runs the test suite itself",
           "install": "installs a package into the environment (tests/test_wheel.py does it in a fresh venv)"}
FENCE = re.compile(r"(?:^<!-- readme-test: (?P<marker>[^>]*?) -->\n)?^```(?P<lang>\w*)\n(?P<code>.*?)^```",
                   re.M | re.S)
TIMEOUT_S = 300
README_MAX_LINES = 350  # a product page; details live in docs/
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    marker: str | None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.lang}-line-{self.line}"


def doc_blocks(text: str, page: str = "README.md") -> list[Block]:
    return [Block(page, text.count("\n", 0, m.start("code")) + 1, m["lang"], m["code"], m["marker"])
            for m in FENCE.finditer(text) if m["lang"] in ("python", "bash")]


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


BLOCKS = [b for page in PAGES for b in doc_blocks(page.read_text(encoding="utf-8"), relative(page))]


def test_the_extractor_finds_blocks_and_markers():
    text = ("x\n<!-- readme-test: skip gpu -->\n```bash\nnvidia-smi\n```\n```python\nprint(1)\n```\n"
            "<!-- readme-test: expect 1 2 3 -->\n```bash\necho 1 2 3\n```\n```text\nz\n```\n")
    assert [(b.line, b.lang, b.code, b.marker) for b in doc_blocks(text)] == [
        (4, "bash", "nvidia-smi\n", "skip gpu"), (7, "python", "print(1)\n", None),
        (11, "bash", "echo 1 2 3\n", "expect 1 2 3")]
    runnable = [b for b in BLOCKS if not (b.marker or "").startswith("skip")]
    assert {b.lang for b in runnable} == {"python", "bash"}, "the pages have blocks of both kinds that run"
    assert {b.page for b in BLOCKS} > {"README.md"}, "docs/ pages are collected too"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_doc_block_runs(block, tmp_path):
    kind, _, arg = (block.marker or "").partition(" ")
    assert kind in ("", "skip", "expect"), f"unknown marker {block.marker!r}; use skip REASON or expect TEXT"
    if kind == "skip":
        assert arg in REASONS, f"unknown skip reason {arg!r}; use one of {set(REASONS)}"
        pytest.skip(f"{block.page} line {block.line}: {REASONS[arg]}")
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
    where = f"{block.page} line {block.line}"
    assert proc.returncode == 0, f"{where} failed:\n{out}\n{err}"
    assert out.strip(), f"{where} printed nothing:\n{err}"
    if kind == "expect":
        assert arg in out, f"{where} should print {arg!r} (the right answer on the embedded model):\n{out}"


LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?:#[^)\s]*)?\)")


def test_relative_links_point_at_files():
    missing = []
    for page in PAGES:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))  # code is not prose
        for m in LINK.finditer(text):
            target = m["target"]
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path = (page.parent / target).resolve()
            if not path.exists():
                missing.append(f"{relative(page)}: {target}")
    assert not missing, "links to files that do not exist:\n" + "\n".join(missing)


def test_readme_is_a_product_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count("\n") <= README_MAX_LINES, (
        f"README.md has {text.count(chr(10))} lines; keep it a product page of at most "
        f"{README_MAX_LINES} and move details to docs/")
    assert re.search(r"<!-- bench:readme -->.*<!-- /bench:readme -->", text, re.S), \
        "README.md lost its generated results section (dllm report ... --page README.md --section readme)"


SECTION = re.compile(r"<!-- bench:(?P<name>[a-z0-9-]+) -->.*?<!-- /bench:(?P=name) -->\n?", re.S)


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs" / "benchmarks").glob("*.md")
                                       if p.name != "README.md"))
def test_benchmark_pages_hold_generated_sections_only(page):
    text = (ROOT / "docs" / "benchmarks" / page).read_text(encoding="utf-8")
    names = [m["name"] for m in SECTION.finditer(text)]
    assert names, f"docs/benchmarks/{page} has no generated section"
    rest = [line for line in SECTION.sub("", text).splitlines() if line.strip()]
    # a title and at most one line pointing at how the sections are made
    assert len(rest) <= 2 and rest[0].startswith("# "), (
        f"docs/benchmarks/{page} holds text outside its generated sections: {rest[1:]}; "
        f"tables come from `dllm report`, prose goes to the docs pages")


def test_benchmark_section_names_are_unique():
    """A section's plot is saved as img/NAME.png beside its page: two pages of docs/benchmarks
    with the same section name would overwrite each other's plot."""
    names = [m["name"] for p in sorted((ROOT / "docs" / "benchmarks").glob("*.md"))
             for m in SECTION.finditer(p.read_text(encoding="utf-8"))]
    assert len(names) == len(set(names)), f"section names used twice: {sorted({n for n in names if names.count(n) > 1})}"
