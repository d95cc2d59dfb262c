"""Result files the commands write (``dllm eval --json``, ``dllm bench``'s results.json, ...)
and what a benchmark interrupted by Ctrl-C says it kept."""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import UserError


def write_atomic(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` all at once: ``write`` fills a temporary file in the same folder (opened
    for binary writing), which is flushed to disk, then renamed over ``path``. A failed or
    interrupted write (disk full, Ctrl-C, ...) leaves the previous file as it was and no temporary
    file behind; an OSError is raised again naming ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        # os.open with 0o666: the umask applies as for a plain open (mkstemp would make it 0600)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # Ctrl-C included: no temporary file left behind
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError):
            error = OSError(f"cannot write {path}: {e.strerror or e}")
            error.errno = e.errno
            raise error from None
        raise


def write_json_atomic(path: str | Path, obj) -> None:
    """Write ``obj`` as indented JSON to ``path`` all at once (``write_atomic``)."""
    text = json.dumps(obj, indent=2) + "\n"
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def prepare_out_dir(out_dir: str | Path) -> Path:
    """Create the output folder and check it is writable, before a run rather than after it."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to output folder {str(out)!r}: {e.strerror}") from None
    return out


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a benchmark, after saving what was measured; ``str``: what was written
    (``dllm`` prints it as ``interrupted: ...`` and exits 130)."""


def saved(n: int, unit: str, path: Path) -> str:
    """``3 rows written to OUT/results.json`` (or that nothing was)."""
    if n == 0:
        return f"no {unit} measured yet; {path} not written"
    return f"{n} {unit}{'s' if n != 1 else ''} written to {path}"


def percent(share: float | None) -> str:
    """A share as the tables show it (``87.5%``); ``–`` for one not measured (an accuracy of
    prompts without answers: null in the JSON)."""
    return "–" if share is None else f"{share:.1%}"
