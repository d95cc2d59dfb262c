"""The fast tier (``pytest -m "not slow"``, ``make test-fast``) does not even import the modules
marked slow as a whole (``pytestmark = pytest.mark.slow``): importing them (the server, Ray,
lm-eval) costs more than many fast tests."""
import os
from pathlib import Path

WHOLE_MODULE_SLOW = "\npytestmark = pytest.mark.slow"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if config.option.markexpr.replace(" ", "") != "notslow" or collection_path.suffix != ".py":
        return None
    return WHOLE_MODULE_SLOW in collection_path.read_text() or None


def pytest_configure(config) -> None:
    """Under pytest-xdist (``make test`` runs ``-n 2``) each worker process gets its share of
    the cores as torch threads: torch's default, every core in every process, oversubscribes them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
