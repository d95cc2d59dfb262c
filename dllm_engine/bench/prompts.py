"""Prompts from a JSON-lines file: ``--prompts FILE.jsonl`` of ``dllm bench``, ``dllm bench
serve`` and ``dllm profile``, the engine's own input beside the task suite's splits.

Each non-blank line is one JSON object with ``"prompt"`` (a string: one user message, sent
through the checkpoint's chat template as the task prompts are) or ``"messages"`` (an
OpenAI-style list of ``{"role", "content"}``), and optionally ``"answer"`` (a string) and
``"id"``; other fields are ignored, so a task split file (``id``, ``task``, ``prompt``,
``answer``) reads as it is. When every line has an answer, a prompt is right when its output,
stripped of surrounding whitespace, equals the answer (stripped too); when no line has one there
is no accuracy (None: null in JSON, "–" in tables). A file mixing both is refused, as is any
line that is not such an object, naming the line.

A line becomes a ``PromptExample``, a ``datasets.Prompt`` as a dataset's examples are: it goes
wherever they go (``evaluate``, the benches, the profiler) with its own conversation (``chat``)
and grade (``grades``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}
LINE_FORM = '{"prompt": "...", "answer": "..."} or {"messages": [{"role": "user", "content": "..."}]}'


@dataclass(frozen=True)
class PromptExample:
    """One line of a prompts file. ``task`` is the file's name (the workload a bench row names),
    ``id`` the line's own or ``NAME:LINE``; ``answer`` None when the file has none."""

    task: str
    prompt: str  # the user message, or a conversation's contents joined (what a record shows)
    answer: str | None = None
    id: str | None = None
    messages: tuple[dict, ...] | None = None  # the line's conversation, when it gave one
    source: str = ""  # the file, as given
    line: int = 0  # the line number in it

    @property
    def where(self) -> str:
        """``FILE, line N``: what an error about this prompt names."""
        return f"{self.source}, line {self.line}"

    def chat(self) -> list[dict]:
        """The conversation this prompt is asked as (the chat template applies to it)."""
        if self.messages:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]

    def grades(self, output_text: str) -> tuple[bool | None, None, None]:
        """(whole answer, final answer, form), as ``evaluate`` reads a task's three grades: exact
        match of the stripped output against the stripped answer, None without an answer; a
        file's prompts have no final-answer or form grade."""
        if self.answer is None:
            return None, None, None
        return output_text.strip() == self.answer.strip(), None, None


def load_prompts(path: str | Path, limit: int | None = None) -> list[PromptExample]:
    """The prompts of ``path`` in file order, the first ``limit`` of them (None: all). The whole
    file is checked first: a bad line, an empty file or one mixing lines with and without an
    answer raise ``UserError`` naming the file (and line)."""
    if limit is not None and limit < 1:
        raise UserError(f"limit must be >= 1 or None, got {limit}")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"prompts file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read prompts file {path}: {err}") from None
    rows = [parse_line(path, n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not rows:
        raise UserError(f"prompts file {path} holds no prompts; write one JSON object a line: {LINE_FORM}")
    check_answers(path, rows)
    return rows[:limit]


def parse_line(path: Path, lineno: int, line: str) -> PromptExample:
    """One line as a ``PromptExample``; a ``UserError`` naming the line for anything else."""
    where = f"{path}, line {lineno}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: not JSON ({err.msg} at column {err.colno}); write one JSON object a line: {LINE_FORM}") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: {JSON_TYPES[type(row)]}, not a JSON object; write one JSON object a "
                        f"line: {LINE_FORM}")
    prompt, messages, answer, id_ = row.get("prompt"), row.get("messages"), row.get("answer"), row.get("id")
    if (prompt is None) == (messages is None):
        raise UserError(f'{where}: give one of "prompt" (a string) and "messages" (a list of '
                        f'{{"role", "content"}}), {"not both" if prompt is not None else "found neither"}')
    if prompt is not None and (not isinstance(prompt, str) or not prompt.strip()):
        raise UserError(f'{where}: "prompt" must be a non-empty string, got {prompt!r}')
    if messages is not None:
        messages = check_messages(where, messages)
        prompt = "\n".join(m["content"] for m in messages)
    if answer is not None and not isinstance(answer, str):
        raise UserError(f'{where}: "answer" must be a string, got {answer!r}')
    return PromptExample(task=path.name, prompt=prompt, answer=answer,
                         id=id_ if isinstance(id_, str) else f"{path.name}:{lineno}",
                         messages=messages, source=str(path), line=lineno)


def check_messages(where: str, messages) -> tuple[dict, ...]:
    """``messages`` if it is a non-empty list of ``{"role": str, "content": str}`` (only those
    two fields kept); a ``UserError`` naming the line and the message otherwise."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}}, got {messages!r}')
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"]
                and isinstance(m.get("content"), str)):
            raise UserError(f'{where}: message {i} must be an object with a "role" and a "content" '
                            f"(strings), got {m!r}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def check_answers(path: Path, rows: list[PromptExample]) -> None:
    """Every line with an answer or none: accuracy is over the whole file or not measured."""
    with_answer = [r for r in rows if r.answer is not None]
    if with_answer and len(with_answer) < len(rows):
        without = next(r for r in rows if r.answer is None)
        raise UserError(f'prompts file {path} mixes lines with an "answer" (line {with_answer[0].line}) and '
                        f"without (line {without.line}): give every line an answer (accuracy: exact match) "
                        f"or none (no accuracy)")
