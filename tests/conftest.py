"""The fast tier (``pytest -m "not slow"``, ``make test-fast``) does not even import the modules
marked slow as a whole (``pytestmark = pytest.mark.slow``): importing them (the server, Ray,
lm-eval) costs more than many fast tests."""
from pathlib import Path

WHOLE_MODULE_SLOW = "\npytestmark = pytest.mark.slow"


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    if config.option.markexpr.replace(" ", "") != "notslow" or collection_path.suffix != ".py":
        return None
    return WHOLE_MODULE_SLOW in collection_path.read_text() or None
