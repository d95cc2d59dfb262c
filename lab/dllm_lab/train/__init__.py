"""The trainer of the embedded tiny checkpoints (``checkpoints/tiny-*``, ``dllm train``).

Not an inference module: the engine (``dllm_engine``) never imports it. It
exists so the checkpoints the tests and examples run can be rebuilt from the task suite (CPU,
seeded, resumable); the released models (LLaDA, Dream, SDAR, LLaDA2) are loaded, never trained here."""
from .trainer import TrainConfig, Trainer

__all__ = ["TrainConfig", "Trainer"]
