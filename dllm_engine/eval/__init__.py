"""Accuracy and stats of a decoding method on a dataset's held-out prompts or a prompts file's."""
from .evaluate import EvalReport, TaskResult, evaluate

__all__ = ["EvalReport", "TaskResult", "evaluate"]
