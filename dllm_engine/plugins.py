"""What installed packages add to the engine through entry points: commands (``dllm.commands``,
``cli.all_commands``) and datasets (``dllm.datasets``, ``datasets.registered``). A package whose
entry point cannot be imported (installed half, or removed with its metadata left behind) is
skipped with one warning naming it: the engine's own commands keep working."""
from __future__ import annotations

import warnings
from importlib.metadata import entry_points


class PluginWarning(UserWarning):
    """An installed package's entry point could not be loaded."""


def load(group: str) -> list[tuple[str, object]]:
    """(entry point name, loaded object) of every entry point in ``group`` that loads."""
    loaded = []
    for point in entry_points(group=group):
        try:
            loaded.append((point.name, point.load()))
        except Exception as e:  # an import of another package's code: anything can fail
            package = point.dist.name if point.dist is not None else "a package"
            warnings.warn(f"{package}: its {group} entry point {point.name} = {point.value} cannot be "
                          f"loaded ({type(e).__name__}: {e}); skipped", PluginWarning, stacklevel=2)
    return loaded
