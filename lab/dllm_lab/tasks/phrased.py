"""Phrased tasks: worked solutions and short descriptions in free phrasing, as chat answers are.

The ``worked`` family writes every step in one fixed template, so the position of every word is
known from the prompt and a trained model commits template words far ahead of the frontier. Real
chain-of-thought text does not: a step can be written in several ways of different lengths, with
or without a connective, so a slot ten tokens right of the frontier may hold any word until the
words before it are fixed. Each task here samples, for every step, a connective and a phrasing at
random (``PhrasedTask.STEPS``), so the training stream has that entropy.

Grading is a trace checker, not an exact match: ``check_trace`` accepts every phrasing the
generator can produce and checks every step's result in order and the final answer; ``accuracy``
is the whole trace valid, ``final`` the final answer right however the trace reads. ``describe``
is open-ended (items with counts, in any order and phrasing) and graded by a constraint checker.

Arithmetic stays on single digits (one token each), as in ``worked``: running values are kept
between 0 and 9 by the generators.
"""
from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from .generators import DIGIT_WORDS, DIGITS, NOUNS, Example, Task
from .worked import ITEMS, NAMES

# Slot names in templates: a word in braces is filled from the step's values.
Template = tuple[str, ...]
CONNECTIVES: tuple[Template, ...] = ((), (), ("so",), ("then",), ("next", ","))
FIRST_CONNECTIVES: tuple[Template, ...] = ((), ("first", ","))
SEPARATORS: tuple[str, ...] = (",", ".")  # chosen once per answer: a writer keeps one style

# Items of ``describe`` (plural nouns); counts 2-9 written as a digit or a word.
THINGS: tuple[str, ...] = ("cats", "dogs", "birds", "cups", "hats", "keys", "books", "boxes")
DESCRIBE_OPENERS: tuple[Template, ...] = (
    ("there", "are"), ("i", "see"), ("we", "have"), ("the", "box", "holds"), ("you", "get"))
DESCRIBE_CLOSERS: tuple[Template, ...] = ((), (), ("and", "that", "is", "all"), ("nothing", "else"))


def _t(text: str) -> Template:
    return tuple(text.split())


# step kind -> its phrasings; every kind has >= 4 of different lengths.
CALC_STEPS: dict[str, tuple[Template, ...]] = {
    "plus": tuple(map(_t, ("{a} plus {b} is {c}", "adding {b} to {a} gives {c}", "{a} and {b} make {c}",
                           "we get {c} from {a} + {b}", "{a} + {b} = {c}", "now {c}"))),
    "minus": tuple(map(_t, ("{a} minus {b} is {c}", "taking {b} from {a} leaves {c}",
                            "{a} take away {b} gives {c}", "we get {c} from {a} - {b}", "{a} - {b} = {c}",
                            "now {c}"))),
    "final": tuple(map(_t, ("answer : {c}", "so the answer is {c}", "the result is {c}", "we end with {c}"))),
}
SHOP_STEPS: dict[str, tuple[Template, ...]] = {
    "start": tuple(map(_t, ("{who} starts with {c} {item}", "at first {who} has {c} {item}",
                            "{who} has {c} {item}", "we begin with {c}"))),
    "buy": tuple(map(_t, ("{who} buys {b} , so {a} + {b} = {c}", "after buying {b} {who} has {c} {item}",
                          "{a} {item} and {b} more make {c}", "now {who} has {c} {item}", "buying {b} gives {c}"))),
    "sell": tuple(map(_t, ("{who} sells {b} , so {a} - {b} = {c}", "after selling {b} {who} has {c} {item}",
                           "{a} {item} less {b} leave {c}", "now {who} has {c} {item}", "selling {b} leaves {c}"))),
    "final": tuple(map(_t, ("answer : {c}", "so {who} has {c} {item} now", "{who} ends with {c} {item}",
                            "the answer is {c}"))),
}
BIGGEST_STEPS: dict[str, tuple[Template, ...]] = {
    "start": tuple(map(_t, ("start with {c}", "first we have {c}", "{c} is the biggest so far", "take {c}"))),
    "up": tuple(map(_t, ("{b} is bigger than {a} , so keep {c}", "{b} beats {a}", "{b} > {a} , now {c}",
                         "{b} is more than {a} , the biggest is {c}", "new biggest {c}"))),
    "down": tuple(map(_t, ("{b} is smaller than {a}", "{b} < {a} , still {c}", "{b} is not bigger , keep {c}",
                           "{c} stays", "{b} does not beat {a}"))),
    "same": tuple(map(_t, ("{b} is not bigger , keep {c}", "{c} stays", "{b} does not beat {a}",
                           "{b} equals {a} , still {c}"))),
    "final": tuple(map(_t, ("answer : {c}", "so the biggest is {c}", "the biggest is {c}", "{c} is the biggest"))),
}
TALLY_STEPS: dict[str, tuple[Template, ...]] = {
    "hit": tuple(map(_t, ("{w} counts , that makes {c}", "another {w} , {c}", "{w} again , now {c}",
                          "one more , {c}", "found {c}"))),
    "miss": tuple(map(_t, ("skip {w}", "{w} does not count", "no , still {c}", "{w} , still {c}", "not {w}"))),
    "final": tuple(map(_t, ("answer : {c}", "so there are {c}", "{c} in total", "the count is {c}"))),
}

# Words these tasks add to the vocabulary, appended after the worked family's in this fixed order
# (a test checks every template word is in the vocabulary).
PHRASED_WORDS: tuple[str, ...] = (
    "calc", "shop", "biggest", "tally", "describe",
    "plus", "is", "adding", "to", "and", "make", "we", "get", "from", "minus", "taking", "leaves",
    "take", "so", "the", "result", "end", "with", "then", "next", "first",
    "starts", "at", "begin", "buys", "buying", "after", "less", "leave", "sells", "selling", "ends",
    "start", "bigger", "than", "keep", "beats", ">", "<", "still", "smaller", "not", "does", "beat",
    "stays", "equals", "far", "new", "in", "counts", "that", "makes", "another", "again", "one", "no",
    "found", "skip", "there", "are", "total", "count", "have",
    "i", "see", "box", "holds", "you", "all", "nothing", "else", *THINGS)


@dataclass(frozen=True)
class Step:
    """One step of a trace: its kind (a key of the task's ``STEPS``) and the slot values."""

    kind: str
    values: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, kind: str, **values: object) -> Step:
        return cls(kind, tuple((k, str(v)) for k, v in values.items()))


def connectives_of(kind: str, index: int) -> tuple[Template, ...]:
    """The connectives a step may open with: none before a trace's start or final line,
    ``first ,`` or none before a first operation, one of ``CONNECTIVES`` after it."""
    if kind in ("start", "final"):
        return ((),)
    return FIRST_CONNECTIVES if index == 0 else CONNECTIVES


def render(template: Template, values: dict[str, str]) -> list[str]:
    """The template's words with every ``{slot}`` filled."""
    return [values[w[1:-1]] if w.startswith("{") and w.endswith("}") and len(w) > 2 else w for w in template]


class _End:
    """The type of ``END``."""

    def __repr__(self) -> str:
        return "END"


END = _End()  # in a canvas: the answer has ended (a stop token); only ever after the trace
Word = str | None | _End  # a canvas slot: a word, ``None`` (masked: any word) or ``END``


def fills(got: Word, want: str) -> bool:
    """``got`` may stand where the word ``want`` is written: it is that word, or masked."""
    return got is None or got == want


def match(template: Template, words: tuple[Word, ...], pos: int, values: dict[str, str] | None) -> int | None:
    """The end of ``template`` matched at ``words[pos:]`` with its slots equal to ``values``
    (``None``: any word fills a slot; a masked slot, ``None``, matches any word), or None."""
    end = pos + len(template)
    if end > len(words):
        return None
    got = words[pos:end]
    if values is None:
        same = all((w.startswith("{") and g is not END) or fills(g, w) for w, g in zip(template, got))
        return end if same else None
    return end if all(map(fills, got, render(template, values))) else None


def same_place_kinds(steps: dict[str, tuple[Template, ...]], kind: str) -> tuple[str, ...]:
    """The step kinds that may stand where a step of ``kind`` does, whatever the values: the
    start kind, the final kind, or any kind between them."""
    if kind in ("start", "final"):
        return (kind,)
    return tuple(k for k in steps if k not in ("start", "final"))


class PhrasedTask(Task):
    """A worked solution in free phrasing: ``trace(args)`` gives the steps (and the final step),
    ``STEPS`` their phrasings; the answer samples one phrasing and connective per step."""

    has_final_answer = True
    has_form = True
    STEPS: ClassVar[dict[str, tuple[Template, ...]]]

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        args = self.problem(rng)
        return args, self.phrase(self.trace(args), rng)

    def problem(self, rng: random.Random) -> list[str]:
        """The prompt words after ``name :``."""
        raise NotImplementedError

    def trace(self, args: list[str]) -> list[Step]:
        """The steps that solve ``args``, the last of kind ``final``."""
        raise NotImplementedError

    def phrase(self, steps: list[Step], rng: random.Random) -> list[str]:
        """One phrasing of ``steps``: a separator style, then a connective and a template drawn
        for every step (``continue_writing`` from nothing written)."""
        return continue_writing(self, steps, WritingState(1.0, rng.choice(SEPARATORS), (), 0), rng)

    # -- grading ----------------------------------------------------------------------------
    def prompt_args(self, example: Example) -> list[str]:
        head, sep, tail = example.prompt.partition(":")
        return tail.split()

    def grade(self, output_text: str, example: Example) -> bool:
        """The whole trace valid: every step in order, with its result, in a phrasing the
        generator can produce (``check_trace``)."""
        return check_trace(self, tuple(self.trace(self.prompt_args(example))), tuple(output_text.split()))

    def final_answer(self, text: str, values: dict[str, str] | None = None) -> str:
        """The final result read from the last step's phrasing at the end of ``text`` ('' when
        no final phrasing ends it)."""
        words = text.split()
        for template in self.STEPS["final"]:
            n = len(template)
            if len(words) < n:
                continue
            tail = words[-n:]
            got: dict[str, str] = {}
            for want, word in zip(template, tail):
                if want.startswith("{"):
                    if got.setdefault(want, word) != word:
                        break
                elif want != word:
                    break
            else:
                if "{c}" in got and got["{c}"] in DIGITS:
                    return got["{c}"]
        return ""

    def grade_final(self, output_text: str, example: Example) -> bool:
        """The final result alone: a wrong trace with the right result passes."""
        steps = self.trace(self.prompt_args(example))
        return self.final_answer(output_text) == dict(steps[-1].values)["c"]

    def grade_form(self, output_text: str, example: Example) -> bool:
        """The trace's form alone: the right number of steps, each in a phrasing the generator
        can produce at its place, whatever the values in its slots (``check_trace(form=True)``).
        A right form with a wrong trace is a computing error; a wrong form, a phrasing one."""
        return check_trace(self, tuple(self.steps_of(example)), tuple(output_text.split()), form=True)

    def steps_of(self, example: Example) -> list[Step]:
        """The steps of ``example``'s problem (its trace, final step included)."""
        return self.trace(self.prompt_args(example))


@dataclass(frozen=True)
class WritingState:
    """Where the generator stands after writing a prefix one way: the separator style it chose,
    the words it has still to write of the step under way, the index of the step after that,
    and the probability of the choices that wrote the prefix so."""

    weight: float
    sep: str
    pending: tuple[str, ...]
    next_step: int


def write_step(step: Step, k: int, sep: str, conn: Template, template: Template) -> tuple[str, ...]:
    """Step ``k`` written with ``conn`` and ``template``, after ``sep`` unless it is the first."""
    return (sep,) * (k > 0) + conn + tuple(render(template, dict(step.values)))


def step_writings(task: PhrasedTask, step: Step, k: int, sep: str) -> dict[tuple[str, ...], float]:
    """The words step ``k`` can be written as (its separator, connective and phrasing), each with
    its probability under ``phrase``; choices that write the same words are one."""
    conns, templates = connectives_of(step.kind, k), task.STEPS[step.kind]
    out: dict[tuple[str, ...], float] = {}
    for conn in conns:
        for template in templates:
            words = write_step(step, k, sep, conn, template)
            out[words] = out.get(words, 0.0) + 1 / len(conns) / len(templates)
    return out


def writing_states(task: PhrasedTask, steps: list[Step], prefix: list[str]) -> list[WritingState]:
    """Every way the generator can have written ``prefix`` (the first words of a phrasing of
    ``steps``), weighted by its probability; empty if no phrasing starts so."""
    out: list[WritingState] = []

    def walk(sep: str, k: int, pos: int, weight: float) -> None:
        if pos == len(prefix):
            out.append(WritingState(weight, sep, (), k))
            return
        if k == len(steps):
            return
        for words, share in step_writings(task, steps[k], k, sep).items():
            rest = tuple(prefix[pos:pos + len(words)])
            if words[:len(rest)] != rest:
                continue
            if len(rest) < len(words):  # the prefix ends inside this step
                out.append(WritingState(weight * share, sep, words[len(rest):], k + 1))
            else:
                walk(sep, k + 1, pos + len(words), weight * share)

    for sep in SEPARATORS:
        walk(sep, 0, 0, 1 / len(SEPARATORS))
    return out


def continue_writing(task: PhrasedTask, steps: list[Step], state: WritingState,
                     rng: random.Random, limit: int | None = None) -> list[str]:
    """The rest of an answer from ``state``, each later step's connective and phrasing drawn as
    ``phrase`` draws them (``limit``: at least its first ``limit`` words, not all)."""
    words = list(state.pending)
    for k in range(state.next_step, len(steps)):
        if limit is not None and len(words) >= limit:
            break
        conn = rng.choice(connectives_of(steps[k].kind, k))  # drawn first, as ever: seeded splits
        words += write_step(steps[k], k, state.sep, conn, rng.choice(task.STEPS[steps[k].kind]))
    return words


def placements(task: PhrasedTask, steps: tuple[Step, ...], k: int, words: tuple[Word, ...], sep: str,
               pos: int, form: bool = False) -> Iterator[tuple[float, Template, Template, int]]:
    """Each way step ``k`` can stand in the canvas ``words`` from ``pos`` (after ``sep`` unless it
    is the first): its connective, its template, where it ends, and the probability ``phrase``
    writes that connective and template for its kind (``form``: a template of any kind that may
    stand at the step's place, slots unchecked). Each distinct choice once."""
    step = steps[k]
    if k:
        if pos >= len(words) or not fills(words[pos], sep):
            return
        pos += 1
    kinds = same_place_kinds(task.STEPS, step.kind) if form else (step.kind,)
    conns, templates = connectives_of(step.kind, k), [t for kind in kinds for t in task.STEPS[kind]]
    values = None if form else dict(step.values)
    for conn, conn_count in Counter(conns).items():
        after = pos + len(conn)
        if after > len(words) or not all(map(fills, words[pos:after], conn)):
            continue
        for template, count in Counter(templates).items():
            end = match(template, words, after, values)
            if end is not None:
                yield conn_count / len(conns) * count / len(templates), conn, template, end


def ends_the_trace(words: tuple[Word, ...], pos: int) -> bool:
    """Nothing but masked slots and stop tokens from ``pos`` on."""
    return all(w is None or w is END for w in words[pos:])


@functools.lru_cache(maxsize=8192)
def _check(task: PhrasedTask, steps: tuple[Step, ...], words: tuple[Word, ...], sep: str,
           form: bool = False) -> bool:
    """``words`` phrases ``steps``, each after ``sep`` (``form``: in a phrasing of any kind that
    may stand at the step's place, slots unchecked), then holds only masked slots and ``END``."""
    memo: dict[tuple[int, int], bool] = {}

    def rest(k: int, pos: int) -> bool:  # words[pos:] phrases steps[k:]
        if k == len(steps):
            return ends_the_trace(words, pos)
        if (k, pos) not in memo:
            memo[k, pos] = any(rest(k + 1, end) for *_, end in placements(task, steps, k, words, sep, pos, form))
        return memo[k, pos]

    return rest(0, 0)


def check_trace(task: PhrasedTask, steps: tuple[Step, ...], words: tuple[Word, ...],
                form: bool = False) -> bool:
    """``words`` is a phrasing of ``steps`` the generator can produce: every step in order with
    its values, one connective and one template each, one separator kind throughout. ``form``
    checks only the shape: as many steps, each in a phrasing of a kind that may stand there
    (``same_place_kinds``), any word in its slots.

    ``words`` may also be a decoder's canvas: ``None`` for a slot still masked (any word may
    come there) and ``END`` for a stop token, which may only follow the trace. It is then
    whether the canvas can still be completed into such a phrasing, ending at or before its
    last slot; committing more slots never makes an unfinishable canvas finishable again."""
    return any(_check(task, steps, words, sep, form) for sep in SEPARATORS)


def fill_canvas(task: PhrasedTask, steps: tuple[Step, ...], words: tuple[Word, ...],
                rng: random.Random) -> list[str] | None:
    """A phrasing of ``steps`` that fits the canvas ``words`` (as ``check_trace`` reads one: its
    written words kept, its masked slots filled, its stop tokens after the trace), drawn with the
    probability ``phrase`` gives it among the phrasings that fit; None if none fits.

    A decoder that commits ahead leaves canvases no gold answer passes through; this is the
    answer such a canvas should be finished into (``dllm canvas-rows``)."""
    def choices(sep: str, k: int, pos: int) -> list[tuple[float, tuple[str, ...], int]]:
        """(probability, words, end) of each way step ``k`` can be written from ``pos``."""
        return [(p, write_step(steps[k], k, sep, conn, template), end)
                for p, conn, template, end in placements(task, steps, k, words, sep, pos)]

    def weight(sep: str, k: int, pos: int, memo: dict) -> float:
        """The probability that steps k.. written from ``pos`` fit the rest of the canvas."""
        if k == len(steps):
            return float(ends_the_trace(words, pos))
        if (k, pos) not in memo:
            memo[k, pos] = sum(p * weight(sep, k + 1, end, memo) for p, _, end in choices(sep, k, pos))
        return memo[k, pos]

    memos = {sep: {} for sep in SEPARATORS}
    totals = [weight(sep, 0, 0, memos[sep]) for sep in SEPARATORS]
    if not any(totals):
        return None
    sep = rng.choices(SEPARATORS, weights=totals)[0]
    out: list[str] = []
    k = pos = 0
    while k < len(steps):
        options = [(p * weight(sep, k + 1, end, memos[sep]), written, end) for p, written, end in choices(sep, k, pos)]
        _, written, pos = rng.choices(options, weights=[w for w, _, _ in options])[0]
        out += written
        k += 1
    return out


class CalcTask(PhrasedTask):
    """``calc : 3 + 5 - 2`` -> e.g. ``3 plus 5 is 8 , then taking 2 from 8 leaves 6 , so the
    answer is 6``: an expression evaluated left to right, one phrased step per operation
    (2-24 operations; the running value stays between 0 and 9)."""

    name = "calc"
    STEPS = CALC_STEPS

    def problem(self, rng: random.Random) -> list[str]:
        value = rng.randint(0, 9)
        words = [str(value)]
        for _ in range(rng.randint(2, 24)):
            plus = value < 9 and (value == 0 or rng.random() < 0.5)
            b = rng.randint(1, 9 - value) if plus else rng.randint(1, value)
            value = value + b if plus else value - b
            words += ["+" if plus else "-", str(b)]
        return words

    def trace(self, args: list[str]) -> list[Step]:
        value, steps = int(args[0]), []
        for op, b in zip(args[1::2], args[2::2]):
            new = value + int(b) if op == "+" else value - int(b)
            steps.append(Step.of("plus" if op == "+" else "minus", a=value, b=b, c=new))
            value = new
        return [*steps, Step.of("final", c=value)]


class ShopTask(PhrasedTask):
    """``shop : ann has 3 pens . ann buys 4 . ann sells 2 . how many pens now ?`` -> e.g.
    ``ann starts with 3 pens . after buying 4 ann has 7 pens . selling 2 leaves 5 . answer : 5``:
    a word problem (2-12 purchases and sales, the stock between 0 and 9)."""

    name = "shop"
    STEPS = SHOP_STEPS

    def problem(self, rng: random.Random) -> list[str]:
        who, item, stock = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 9)
        words = [who, "has", str(stock), item, "."]
        for _ in range(rng.randint(2, 12)):
            buy = stock < 9 and (stock == 0 or rng.random() < 0.5)
            b = rng.randint(1, 9 - stock) if buy else rng.randint(1, stock)
            stock = stock + b if buy else stock - b
            words += [who, "buys" if buy else "sells", str(b), "."]
        return [*words, "how", "many", item, "now", "?"]

    def trace(self, args: list[str]) -> list[Step]:
        who, stock, item = args[0], int(args[2]), args[3]
        steps = [Step.of("start", who=who, c=stock, item=item)]
        events = args[5:-5]
        for verb, b in zip(events[1::4], events[2::4]):
            new = stock + int(b) if verb == "buys" else stock - int(b)
            steps.append(Step.of("buy" if verb == "buys" else "sell", who=who, a=stock, b=b, c=new, item=item))
            stock = new
        return [*steps, Step.of("final", who=who, c=stock, item=item)]


class BiggestTask(PhrasedTask):
    """``biggest : 3 7 2 9`` -> e.g. ``start with 3 , 7 beats 3 , 2 < 7 , still 7 , new biggest 9 ,
    the biggest is 9``: a running maximum, one phrased comparison per digit (4-16 digits)."""

    name = "biggest"
    STEPS = BIGGEST_STEPS

    def problem(self, rng: random.Random) -> list[str]:
        return [rng.choice(DIGITS) for _ in range(rng.randint(4, 16))]

    def trace(self, args: list[str]) -> list[Step]:
        best, steps = int(args[0]), []
        steps.append(Step.of("start", c=best))
        for d in map(int, args[1:]):
            kind = "up" if d > best else "down" if d < best else "same"
            steps.append(Step.of(kind, a=best, b=d, c=max(best, d)))
            best = max(best, d)
        return [*steps, Step.of("final", c=best)]


class TallyTask(PhrasedTask):
    """``tally : how many cat in dog cat sun cat ?`` -> e.g. ``skip dog , another cat , 1 , sun ,
    still 1 , cat again , now 2 , so there are 2``: counting one word in a list, one phrased step
    per word (4-16 words from six nouns; the count stays below 10)."""

    name = "tally"
    STEPS = TALLY_STEPS
    WORDS: ClassVar[tuple[str, ...]] = NOUNS[:6]

    def problem(self, rng: random.Random) -> list[str]:
        target = rng.choice(self.WORDS)
        while True:
            words = [rng.choice(self.WORDS) for _ in range(rng.randint(4, 16))]
            if words.count(target) <= 9:
                return ["how", "many", target, "in", *words, "?"]

    def trace(self, args: list[str]) -> list[Step]:
        target, count, steps = args[2], 0, []
        for w in args[4:-1]:
            count += w == target
            steps.append(Step.of("hit" if w == target else "miss", w=w, c=count))
        return [*steps, Step.of("final", c=count)]


class DescribeTask(Task):
    """``describe : 3 cats 2 dogs 5 cups`` -> e.g. ``we have two dogs , 5 cups and 3 cats`` or
    ``i see 5 cups . i see three cats . i see 2 dogs . nothing else``: an open-ended description
    that must mention every given item with its count (a digit or a word), in any order and
    phrasing, and nothing else; graded by a constraint checker (2-6 items, counts 2-9)."""

    name = "describe"
    has_form = True

    def _sample(self, rng: random.Random) -> tuple[list[str], list[str]]:
        things = rng.sample(THINGS, rng.randint(2, 6))
        counts = {t: rng.randint(2, 9) for t in things}
        args = [w for t in things for w in (str(counts[t]), t)]
        return args, self.phrase(counts, rng)

    def phrase(self, counts: dict[str, int], rng: random.Random) -> list[str]:
        order = rng.sample(list(counts), len(counts))
        mentions = [[rng.choice((str(counts[t]), DIGIT_WORDS[counts[t]])), t] for t in order]
        if rng.random() < 0.5:  # one sentence listing them all
            words = list(rng.choice(DESCRIBE_OPENERS))
            for i, m in enumerate(mentions):
                words += ([] if i == 0 else ["and"] if i == len(mentions) - 1 else [","]) + m
            closer = rng.choice(DESCRIBE_CLOSERS)
            return words + ([] if not closer else ["."] + list(closer) if closer[0] != "and" else list(closer))
        opener = rng.choice(DESCRIBE_OPENERS)  # a sentence per item
        words = [w for i, m in enumerate(mentions) for w in ([] if i == 0 else ["."]) + list(opener) + m]
        closer = rng.choice(DESCRIBE_CLOSERS)
        return words + ([] if not closer else ["."] + list(closer) if closer[0] != "and" else list(closer))

    def grade(self, output_text: str, example: Example) -> bool:
        """Every given item mentioned once with its count (digit or word), no other item or count,
        and every other word one of the descriptions' own (openers, ``,`` ``and`` ``.``, closers)."""
        return describe_ok(output_text.split(), example.prompt.partition(":")[2].split())

    def grade_form(self, output_text: str, example: Example) -> bool:
        """The description's form alone: an opener, then mentions (a count and an item, each
        item once) and the descriptions' own glue words, whichever items and counts they name."""
        return describe_ok(output_text.split(), example.prompt.partition(":")[2].split(), form=True)

    def results(self, answer: str) -> int:
        return sum(w in THINGS for w in answer.split())


GLUE: frozenset[str] = frozenset({",", ".", "and", *(w for o in DESCRIBE_OPENERS for w in o),
                                  *(w for c in DESCRIBE_CLOSERS for w in c)})


def describe_ok(words: list[str], args: list[str], form: bool = False) -> bool:
    """The ``describe`` constraint check of ``words`` against the prompt's ``count thing`` pairs
    (``form``: the shape only, not which items and counts are mentioned)."""
    want = Counter({t: int(n) for n, t in zip(args[::2], args[1::2])})
    if not words or not any(tuple(words[:len(o)]) == o for o in DESCRIBE_OPENERS):
        return False
    got: dict[str, int] = {}
    i = 0
    while i < len(words):
        w = words[i]
        count = int(w) if w in DIGITS else DIGIT_WORDS.index(w) if w in DIGIT_WORDS else None
        if count is not None:
            if i + 1 >= len(words) or words[i + 1] not in THINGS or words[i + 1] in got:
                return False
            got[words[i + 1]] = count
            i += 2
        elif w in GLUE:
            i += 1
        else:
            return False
    return form or got == dict(want)


PHRASED_TASKS: tuple[Task, ...] = (CalcTask(), ShopTask(), BiggestTask(), TallyTask(), DescribeTask())
