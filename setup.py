"""Everything about the package is in pyproject.toml except this: the embedded checkpoints.

``checkpoints/`` at the repository root is their source of truth (``dllm train`` writes there, the
docs and tests cite it); the wheel ships them inside the package as ``dllm_engine/checkpoints/``
(``cli.common.embedded_checkpoints`` finds either). pyproject's package finder cannot map a folder
from outside the package, so the package list is given here, with that one mapped folder added."""
from setuptools import find_namespace_packages, setup

setup(packages=[*find_namespace_packages(include=["dllm_engine*"]), "dllm_engine.checkpoints"],
      package_dir={"dllm_engine.checkpoints": "checkpoints"})
