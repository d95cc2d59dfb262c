"""Worked-answer tasks: answers written out step by step, like a chain of thought.

The ``copy`` suite (``generators``) has short answers that a model can write all at once. Real
dLLM workloads (GSM8K solutions, code) are long and sequential: most answer tokens depend on
earlier answer tokens, so a model can commit only a few per step. Each task here writes its
intermediate results, so every later token is a function of the prompt and the answer so far,
and the number of tokens a confident model can commit per step is bounded by that dependency
chain, not by the canvas. Every task ends with (or is) a final result that ``final_answer`` reads
for a second, final-answer-only grade.

Arithmetic stays on single digits (one token each): running totals keep their last digit, the
column addition writes its carry, and the word problems keep totals between 0 and 9.
"""
from __future__ import annotations

import random
from typing import ClassVar

from .generators import DIGITS, Example, Task

# Words these tasks add to the vocabulary (appended after the copy suite's, so its ids stay).
NAMES: tuple[str, ...] = ("ann", "bob", "tom", "eve", "sam", "kim")
ITEMS: tuple[str, ...] = ("apples", "pens", "coins", "cards")
STORY_WORDS: tuple[str, ...] = ("has", "gets", "gives", "more", "away", "how", "many", "now", ".")
WORKED_WORDS: tuple[str, ...] = (
    "+", "-", "answer", "sum", "add", "insert", "story", *NAMES, *ITEMS, *STORY_WORDS)


class WorkedTask(Task):
    """A task whose answer is a worked solution; ``final_answer`` extracts the final result."""

    has_final_answer = True

    def final_answer(self, text: str) -> str:
        """The final result: the words after the last ``answer :``."""
        head, sep, tail = text.rpartition("answer :")
        return tail.strip() if sep else ""

    def grade_final(self, output_text: str, example: Example) -> bool:
        """The final result alone, exactly: a wrong trace with the right result passes."""
        return self.final_answer(output_text) == self.final_answer(example.answer)

    def results(self, answer: str) -> int:
        """The intermediate results ``answer`` writes, each from the one before it: here the
        clauses ``... = R`` (a running total, a column with its carry, a story's count)."""
        return answer.split().count("=")


class RunningSumTask(WorkedTask):
    """``sum : 3 5 2 8`` -> ``3 + 5 = 8 , 8 + 2 = 0 , 0 + 8 = 8 , answer : 8``.

    The last digit of a running total, one addition per clause: the left operand is the previous
    clause's result, the right one the next prompt digit. 4-30 digits (21-177 answer tokens).
    """

    name = "sum"

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        digits = [int(rng.choice(DIGITS)) for _ in range(rng.randint(4, 30))]
        answer, total = [], digits[0]
        for d in digits[1:]:
            answer += [str(total), "+", str(d), "=", str((total + d) % 10), ","]
            total = (total + d) % 10
        return [str(d) for d in digits], answer + ["answer", ":", str(total)]


class ColumnAddTask(WorkedTask):
    """``add : 4 7 5 + 3 8 9`` -> ``5 + 9 + 0 = 1 4 , 7 + 8 + 1 = 1 6 , 4 + 3 + 1 = 0 8 ,
    answer : 8 6 4``.

    School addition of two n-digit numbers (2-14 digits, 22-143 answer tokens), right to left;
    each column writes ``a + b + carry = carry' digit``. The answer is the digits read back
    from the last column to the first, with the final carry in front when it is 1.
    """

    name = "add"

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        n = rng.randint(2, 14)
        a, b = ([rng.choice(DIGITS) for _ in range(n)] for _ in range(2))
        a[0], b[0] = rng.choice(DIGITS[1:]), rng.choice(DIGITS[1:])  # no leading zeros
        answer, digits, carry = [], [], 0
        for x, y in zip(reversed(a), reversed(b)):
            s = int(x) + int(y) + carry
            answer += [x, "+", y, "+", str(carry), "=", str(s // 10), str(s % 10), ","]
            digits.append(str(s % 10))
            carry = s // 10
        result = (["1"] if carry else []) + digits[::-1]
        return [*a, "+", *b], answer + ["answer", ":", *result]


class InsertionSortTask(WorkedTask):
    """``insert : 3 1 4`` -> ``3 : 3 | 1 : 1 3 | 4 : 1 3 4 , answer : 1 3 4``.

    Insertion sort, one pass per prompt digit: the digit taken, then the sorted prefix after
    inserting it. 4-12 digits (28-128 answer tokens).
    """

    name = "insert"

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        digits = [rng.choice(DIGITS) for _ in range(rng.randint(4, 12))]
        passes, prefix = [], []
        for d in digits:
            prefix = sorted([*prefix, d])
            passes.append([d, ":", *prefix])
        trace = [w for i, p in enumerate(passes) for w in ([] if i == 0 else ["|"]) + p]
        return digits, trace + [",", "answer", ":", *prefix]

    def results(self, answer: str) -> int:
        """The passes (``d : sorted prefix``), each the previous one with ``d`` inserted."""
        return answer.split(",")[0].count(":")


class StoryTask(WorkedTask):
    """``story : ann has 3 pens . ann gets 4 more . ann gives 2 away . how many pens now ?`` ->
    ``3 + 4 = 7 , 7 - 2 = 5 , answer : 5``.

    A templated word problem with 2-12 chained steps; totals stay between 0 and 9, so each
    step is one single-digit addition or subtraction (15-75 answer tokens).
    """

    name = "story"
    GETS: ClassVar[tuple[str, str]] = ("gets", "more")
    GIVES: ClassVar[tuple[str, str]] = ("gives", "away")

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        who, item = rng.choice(NAMES), rng.choice(ITEMS)
        total = rng.randint(1, 9)
        words, answer = [who, "has", str(total), item, "."], []
        for _ in range(rng.randint(2, 12)):
            gets = total < 9 and (total == 0 or rng.random() < 0.5)
            amount = rng.randint(1, 9 - total) if gets else rng.randint(1, total)
            verb, adverb = self.GETS if gets else self.GIVES
            words += [who, verb, str(amount), adverb, "."]
            new = total + amount if gets else total - amount
            answer += [str(total), "+" if gets else "-", str(amount), "=", str(new), ","]
            total = new
        return [*words, "how", "many", item, "now", "?"], answer + ["answer", ":", str(total)]


WORKED_TASKS: tuple[WorkedTask, ...] = (RunningSumTask(), ColumnAddTask(), InsertionSortTask(), StoryTask())
