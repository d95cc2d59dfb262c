"""The ``copy`` task suite (short answers) and the task base class.

Every prompt and answer is a single-space-joined sequence of words from the closed
vocabulary ``VOCAB``, so a word-level tokenizer round-trips them exactly. Each task is
shaped for learnability by a 2M-parameter bidirectional model: answers are either
positional copies (reverse, spell), a sort, or computations made *local* by echoing
the operand next to the result (lookup echoes the key, count sorts its keys).
Answer lengths vary within and across tasks so block sizes, EOS handling and length
cutting in the engine all matter; only ``spell`` produces long (up to 119 token) answers.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

DIGITS: tuple[str, ...] = tuple("0123456789")
LETTERS: tuple[str, ...] = tuple("abcdefghijklmnopqrstuvwxyz")
DIGIT_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# Nouns for ``reverse``; none collides with an instruction, digit or role word.
NOUNS: tuple[str, ...] = (
    "cat", "dog", "sun", "moon", "tree", "fish", "bird", "red", "blue", "green",
    "star", "rain", "snow", "road", "book", "door", "ship", "king", "bell", "milk",
    "fire", "wind", "gold", "lamp")
PUNCTUATION: tuple[str, ...] = (":", ",", "=", "?", "|")
INSTRUCTIONS: tuple[str, ...] = ("sort", "reverse", "spell", "lookup", "dedup", "count")

# The copy suite's closed word list, in a fixed order so tokenizer ids never shift between builds
# (``registry.VOCAB`` appends the worked tasks' words after it).
COPY_VOCAB: tuple[str, ...] = DIGITS + LETTERS + DIGIT_WORDS + NOUNS + PUNCTUATION + INSTRUCTIONS


@dataclass(frozen=True)
class Example:
    """One prompt/answer pair; ``id`` is set only for rows of a committed split."""

    task: str
    prompt: str
    answer: str
    id: str | None = None

    def chat(self) -> list[dict]:
        """The conversation it is asked as: its prompt, the one user message (the engine's
        ``datasets.Prompt``)."""
        return [{"role": "user", "content": self.prompt}]

    def grades(self, output_text: str) -> tuple[bool, bool | None, bool | None]:
        """(whole answer, final answer, form) grades of ``output_text`` by its task's graders
        (None for a grade the task does not have)."""
        from .splits import grade, grade_final, grade_form
        return grade(self, output_text), grade_final(self, output_text), grade_form(self, output_text)


class Task(ABC):
    """A named generator plus its exact-match grader.

    Subclasses only return token lists; joining them here guarantees the single-space,
    no-padding text format that the tokenizer round-trip relies on.
    """

    name: ClassVar[str]
    has_final_answer: ClassVar[bool] = False  # ``grade_final`` grades (the worked family)
    has_form: ClassVar[bool] = False  # ``grade_form`` grades (the phrased family)

    def generate(self, rng: random.Random) -> Example:
        """Draw one example using only ``rng``, so equal seeds give equal examples."""
        args, answer = self._sample(rng)
        prompt = " ".join([self.name, ":", *args])
        return Example(task=self.name, prompt=prompt, answer=" ".join(answer))

    def grade(self, output_text: str, example: Example) -> bool:
        """Exact match; only surrounding whitespace is forgiven (decoders may add it)."""
        return output_text.strip() == example.answer

    def grade_final(self, output_text: str, example: Example) -> bool | None:
        """The final-answer-only grade, for a task whose answer ends in a final result (the
        worked family); None for a task that has none."""
        return None

    def grade_form(self, output_text: str, example: Example) -> bool | None:
        """The form-only grade, for a task whose answers may be phrased in many ways (the phrased
        family): the answer's shape right whatever values it holds; None for a task without one."""
        return None

    @abstractmethod
    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        """Return (prompt words after ``name :``, answer words)."""


class SortTask(Task):
    """``sort : 3 9 1 4`` -> ``1 3 4 9``; 4-12 digits, duplicates allowed."""

    name = "sort"

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        items = [rng.choice(DIGITS) for _ in range(rng.randint(4, 12))]
        return items, sorted(items)


class ReverseTask(Task):
    """``reverse : cat sun dog tree`` -> ``tree dog sun cat``; 4-12 nouns."""

    name = "reverse"

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        items = [rng.choice(NOUNS) for _ in range(rng.randint(4, 12))]
        return items, items[::-1]


class SpellTask(Task):
    """``spell : 3 0 7`` -> ``3 = three , 0 = zero , 7 = seven``; 3-30 digits.

    The long-answer task (11-119 tokens). Echoing each digit before its word keeps the
    spelling a function of the adjacent token, leaving only a positional copy to learn.
    """

    name = "spell"

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        digits = [rng.choice(DIGITS) for _ in range(rng.randint(3, 30))]
        answer: list[str] = []
        for i, d in enumerate(digits):
            answer += ([","] if i else []) + [d, "=", DIGIT_WORDS[int(d)]]
        return digits, answer


class LookupTask(Task):
    """``lookup : a = 3 , c = 7 , f = 1 ? c a c f`` -> ``c 7 a 3 c 7 f 1``.

    3-5 distinct letter keys with digit values, 4-8 queries (repeats allowed). The
    answer echoes each query key before its value: a prototype that had to emit bare
    values scored 13%, because the model must both locate the j-th query and match it;
    with the echo, the value only depends on the token right before it.
    """

    name = "lookup"

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        keys = rng.sample(LETTERS, rng.randint(3, 5))
        table = {k: rng.choice(DIGITS) for k in keys}
        queries = [rng.choice(keys) for _ in range(rng.randint(4, 8))]
        pairs = " , ".join(f"{k} = {v}" for k, v in table.items()).split()
        answer = [w for q in queries for w in (q, table[q])]
        return [*pairs, "?", *queries], answer


class DedupTask(Task):
    """``dedup : b a b c a d`` -> ``b a c d``; 5-14 letters from a-j, 4-8 distinct."""

    name = "dedup"
    ALPHABET: ClassVar[tuple[str, ...]] = LETTERS[:10]

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        n = rng.randint(5, 14)
        distinct = rng.sample(self.ALPHABET, rng.randint(4, min(n, 8)))
        items = distinct + [rng.choice(distinct) for _ in range(n - len(distinct))]
        rng.shuffle(items)
        return items, list(dict.fromkeys(items))


class CountTask(Task):
    """``count : b a b c a`` -> ``a 2 b 2 c 1``; 4-12 letters from a-f, >= 2 distinct.

    Keys are listed alphabetically (a sort, which the prototype learned well) rather
    than by first appearance, so each count depends only on its adjacent key.
    """

    name = "count"
    ALPHABET: ClassVar[tuple[str, ...]] = LETTERS[:6]

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        while True:
            items = [rng.choice(self.ALPHABET) for _ in range(rng.randint(4, 12))]
            counts = Counter(items)
            if len(counts) >= 2 and max(counts.values()) <= 9:  # counts stay one digit
                break
        answer = [w for k in sorted(counts) for w in (k, str(counts[k]))]
        return items, answer


COPY_TASKS: tuple[Task, ...] = (SortTask(), ReverseTask(), SpellTask(), LookupTask(), DedupTask(), CountTask())
