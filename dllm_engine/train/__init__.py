"""Training of the embedded tiny checkpoints."""
from .trainer import TrainConfig, Trainer

__all__ = ["TrainConfig", "Trainer"]
