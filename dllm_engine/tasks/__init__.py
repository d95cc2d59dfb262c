"""Synthetic task suite for training and evaluating tiny diffusion LMs.

See ``generators`` for the tasks and ``splits`` for the committed held-out split and the
training stream.
"""
from .generators import TASK_NAMES, TASKS, VOCAB, Example, Task
from .splits import check_mix, grade, load_split, train_examples, write_split

__all__ = ["TASKS", "TASK_NAMES", "VOCAB", "Example", "Task",
           "check_mix", "grade", "load_split", "train_examples", "write_split"]
