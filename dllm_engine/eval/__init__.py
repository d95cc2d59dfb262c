"""Accuracy of a decoding method on the held-out split of the task suite."""
from .evaluate import EvalReport, TaskResult, evaluate

__all__ = ["EvalReport", "TaskResult", "evaluate"]
