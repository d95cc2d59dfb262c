"""Synthetic task suites for training and evaluating tiny diffusion LMs.

``generators`` holds the ``copy`` suite (short answers), ``worked`` the worked-answer tasks (long
step-by-step answers), ``registry`` names them and their families, and ``splits`` the committed
held-out split and the training stream.
"""
from .generators import Example, Task
from .registry import TASK_FAMILIES, TASK_NAMES, TASKS, VOCAB, resolve_tasks, task_family
from .splits import check_mix, grade, grade_final, grade_form, load_split, train_examples, write_split

__all__ = ["TASKS", "TASK_NAMES", "TASK_FAMILIES", "VOCAB", "Example", "Task", "check_mix", "grade", "grade_final",
           "grade_form", "load_split", "resolve_tasks", "task_family", "train_examples", "write_split"]
