"""What a playground pane shows, without Gradio: one method's run with its trace (``PaneRun``),
the shared replay timeline of two runs (``timeline``), and a pane's canvas at a step as HTML
(``pane_html``): masked slots, tokens coloured by the step that committed them, the slots a
strategy evicted / skipped / accepted as a draft at that step, and the live stats."""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from ..engine.llm import LLM, RequestOutput
from ..engine.trace import MASK, StepRecord, canvas_frames
from ..methods import DECODERS, default_decoder
from ..sampling_params import SamplingParams
from ..spec import parse_spec
from ..errors import UserError

FPS = 30  # at most this many frames a second while replaying
MARKS = {"evicted": "ev", "skipped": "sk", "accepted": "ac"}  # strategy record key -> slot CSS class


def default_methods(llm: LLM) -> tuple[str, str]:
    """The family's baseline and its accelerated composition: ``block`` / ``block+focus`` for
    block diffusion, ``dual-cache`` / ``dual-cache+adaptive-length+jump-share`` for LLaDA-like
    models, and early skipping in place of jump-share where logits are shifted (Dream)."""
    base = default_decoder(llm.model.family.methods)
    if DECODERS[base].block_causal:
        return base, f"{base}+focus"
    if llm.model.config.logit_shift:
        return base, f"{base}+adaptive-length+early-skip"
    return base, f"{base}+adaptive-length+jump-share"


def pane_params(llm: LLM, spec: str, max_new_tokens: int | None = None) -> SamplingParams:
    """``spec`` (``method[:field=value,...]``) resolved for ``llm``, recording steps; ValueError
    naming what is wrong (a bad spec, or a method the model cannot run)."""
    if not spec or not spec.strip():
        raise UserError("give a method, e.g. dual-cache or block+focus")
    given = {"max_new_tokens": int(max_new_tokens)} if max_new_tokens else {}
    return llm.resolve(parse_spec(spec.strip(), **given).replace(record_steps=True))


@dataclass
class RecordedRun:
    """One pane's generation: its spec, the resolved options and the output with its trace
    (``steps``, each with the run's time at its end): what the replay clock and the summary read."""
    spec: str
    params: object  # SamplingParams (CanvasParams for a canvas model)
    output: RequestOutput
    stop_ids: frozenset[int]

    @property
    def steps(self) -> list:
        return self.output.steps or []

    @property
    def prompt_len(self) -> int:
        return len(self.output.prompt_token_ids)

    @property
    def seconds(self) -> float:
        return self.steps[-1].seconds if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        s = self.output.stats
        return s.output_tokens / s.seconds if s.seconds else 0.0


@dataclass
class PaneRun(RecordedRun):
    """A masked-diffusion pane's run (``StepRecord`` steps) and its canvas after each step."""
    frames: list[list[int | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.frames = canvas_frames(self.steps, self.prompt_len)

    @property
    def initial_slots(self) -> int:
        """Answer slots before the first step (``Sequence``'s canvas: whole blocks)."""
        p = self.params
        if not p.decoder.block_causal:
            return p.generation_slots
        return -(-(self.prompt_len + p.max_new_tokens) // p.block_length) * p.block_length - self.prompt_len


def answer_message(llm, params, message: str, chat: bool) -> RequestOutput:
    """``message`` generated with ``params``, as a one-turn chat when ``chat`` (any family's LLM)."""
    if chat:
        return llm.chat([{"role": "user", "content": message}], params)[0]
    return llm.generate([message], params)[0]


def run_pane(llm: LLM, spec: str, params: SamplingParams, message: str, chat: bool) -> PaneRun:
    """Generate ``message`` (as a one-turn chat when ``chat``) with ``params``."""
    return PaneRun(spec, params, answer_message(llm, params, message, chat), llm.token_ids.stop_ids)


# -- replay ------------------------------------------------------------------------------------
def timeline(runs: list[PaneRun], replay_seconds: float) -> list[tuple[list[int], float]]:
    """Frames to show: (the step each pane is at, -1 before its first; seconds to wait first).

    ``replay_seconds`` 0: step by step, every pane advancing one step a frame (a finished pane
    stays), no waits. Otherwise the recorded step times of all panes on one clock, slowed or
    sped up so the slowest run lasts ``replay_seconds`` (at most ``FPS`` frames a second)."""
    counts = [len(r.steps) for r in runs]
    if replay_seconds <= 0:
        return [([min(i, n - 1) for n in counts], 0.0) for i in range(-1, max(counts))]
    scale = replay_seconds / max(max(r.seconds for r in runs), 1e-9)
    ticks = sorted({round(s.seconds * scale * FPS) for r in runs for s in r.steps})
    frames, last = [([-1] * len(runs), 0.0)], 0
    for tick in ticks:
        at = [sum(round(s.seconds * scale * FPS) <= tick for s in r.steps) - 1 for r in runs]
        frames.append((at, (tick - last) / FPS))
        last = tick
    return frames


# -- HTML --------------------------------------------------------------------------------------
def step_colour(step: int, num_steps: int) -> str:
    """Blue (first step) to red (last step)."""
    hue = 220 - 220 * step / max(num_steps - 1, 1)
    return f"hsl({hue:.0f}, 75%, 82%)"


def token_label(run: PaneRun, token_id: int, text: str | None) -> tuple[str, str]:
    """(text shown, extra CSS class): stop tokens shown as a small EOS."""
    if token_id in run.stop_ids:
        return "EOS", " stop"
    if text is None:
        return str(token_id), ""
    return (text.replace(" ", "\u00a0") or "\u2423"), ""


def slot_marks(record: StepRecord | None) -> dict[int, list[str]]:
    """Canvas position -> CSS classes of what a strategy did to it at ``record``'s step."""
    marks: dict[int, list[str]] = {}
    if record is None:
        return marks
    for rec in record.strategies.values():
        for key, css in MARKS.items():
            for item in rec.get(key, []):
                marks.setdefault(item[0] if isinstance(item, list) else item, []).append(css)
    for c in record.committed:
        marks.setdefault(c.position, []).append("new")
    return marks


def slot_html(run: PaneRun, pos: int, token: int | None, committed_at: dict[int, tuple[int, str | None]],
              marks: list[str]) -> str:
    """One canvas slot: masked, or its token coloured by its step."""
    css = " ".join(marks)
    if token is MASK:
        return f'<span class="slot mask {css}" data-pos="{pos}" title="slot {pos - run.prompt_len}: masked">\u00b7</span>'
    step, text = committed_at[pos]
    label, extra = token_label(run, token, text)
    title = f"slot {pos - run.prompt_len}: step {step}"
    return (f'<span class="slot tok{extra} {css}" data-pos="{pos}" data-tok="{token}" data-step="{step}" '
            f'style="background:{step_colour(step, len(run.steps))}" title="{title}">{html.escape(label)}</span>')


def stats_line(run: PaneRun, at: int) -> str:
    """nfe, tokens per step, redundancy and tok/s after step ``at`` (-1: before the first)."""
    done = run.steps[: at + 1]
    if not done:
        return "nfe 0"
    decoded = sum(len(r.committed) for r in done)
    processed = sum(r.processed_tokens for r in done)
    answer = sum(tok is not MASK and tok not in run.stop_ids for tok in run.frames[at])
    seconds = done[-1].seconds
    return (f"nfe {len(done)} · {decoded} slots committed · {decoded / len(done):.2f} tok/step · "
            f"redundancy {processed / decoded if decoded else 0:.2f} · {answer / seconds if seconds else 0:.0f} tok/s")


def pane_html(run: PaneRun, at: int, label: str) -> str:
    """The pane after step ``at`` (-1: before the first step): stats line and canvas."""
    done = at == len(run.steps) - 1
    record = run.steps[at] if at >= 0 else None
    committed_at = {c.position: (r.step, c.text) for r in run.steps[: at + 1] for c in r.committed}
    marks = slot_marks(record) if not done else {}  # a finished canvas: colours only
    frame = run.frames[at] if at >= 0 else [MASK] * run.initial_slots
    slots = "".join(slot_html(run, run.prompt_len + i, tok, committed_at, marks.get(run.prompt_len + i, []))
                    for i, tok in enumerate(frame))
    note = cut_note(run, at)
    status = "finished" if done else f"step {at + 1} of {len(run.steps)}"
    return (f'<div class="dllm-pane" data-pane="{label}" data-done="{str(done).lower()}" data-step="{at}">'
            f'<div class="dllm-head"><b>{label}</b> <code>{html.escape(run.spec)}</code> · {status}</div>'
            f'<div class="dllm-stats">{stats_line(run, at)}</div>'
            f'<div class="dllm-canvas">{slots}</div>{note}</div>')


def cut_note(run: PaneRun, at: int) -> str:
    """A line when adaptive length has cut the canvas by step ``at``."""
    cuts = [r.strategies["adaptive-length"] for r in run.steps[: at + 1] if "adaptive-length" in r.strategies]
    if not cuts:
        return ""
    return f'<div class="dllm-note">adaptive length cut the answer to {cuts[-1]["answer_slots"]} slots</div>'


def error_html(label: str, spec: str, message: str) -> str:
    return (f'<div class="dllm-pane" data-pane="{label}" data-done="error"><div class="dllm-head"><b>{label}</b> '
            f'<code>{html.escape(spec or "")}</code></div><div class="dllm-error">{html.escape(message)}</div></div>')


def empty_html(label: str, spec: str) -> str:
    return (f'<div class="dllm-pane" data-pane="{label}" data-done="false"><div class="dllm-head"><b>{label}</b> '
            f'<code>{html.escape(spec)}</code> · waiting for a message</div></div>')


def speedup_text(runs: list[PaneRun]) -> str:
    """The final comparison: B's tok/s over A's, and the forwards each took."""
    a, b = runs
    ratio = b.tokens_per_second / a.tokens_per_second if a.tokens_per_second else float("inf")
    return (f"Pane B (`{b.spec}`) ran at **{ratio:.2f}× the tok/s of pane A** (`{a.spec}`): "
            f"{b.tokens_per_second:.0f} vs {a.tokens_per_second:.0f} tok/s, nfe {b.output.stats.nfe} vs "
            f"{a.output.stats.nfe}, redundancy {b.output.stats.redundancy:.2f} vs {a.output.stats.redundancy:.2f}. "
            "The canvases replayed the recorded traces on one clock.")


LEGEND = ('<span class="slot mask">\u00b7</span> masked · <span class="slot tok" style="background:'
          f'{step_colour(0, 2)}">early</span>…<span class="slot tok" style="background:{step_colour(1, 2)}">late</span> '
          'step that committed a token · <span class="slot tok new">bold</span> committed this step · '
          '<span class="slot mask ev">\u00b7</span> evicted (FOCUS) · <span class="slot mask sk">\u00b7</span> '
          'skipped (early skipping) · <span class="slot tok ac">t</span> accepted draft (jump-share)')

CSS = """
.dllm-pane { font-family: ui-monospace, monospace; font-size: 13px; }
.dllm-head { margin-bottom: 4px; }
.dllm-stats { color: #444; margin-bottom: 6px; }
.dllm-canvas { display: flex; flex-wrap: wrap; gap: 2px; }
.slot { display: inline-block; min-width: 14px; padding: 1px 3px; border-radius: 3px; border: 1px solid transparent;
        text-align: center; font-family: ui-monospace, monospace; font-size: 12px; color: #111; }
.slot.mask { background: #e4e4e4; color: #999; }
.slot.stop { font-size: 9px; color: #555; }
.slot.new { border-color: #111; font-weight: bold; }
.slot.ev { border: 1px dashed #d00; background: #fbe3e3; }
.slot.sk { border: 1px dashed #d80; background: #fdf0dc; }
.slot.ac { border: 2px solid #080; }
.dllm-note { margin-top: 6px; color: #805; }
.dllm-error { color: #b00; white-space: pre-wrap; }
"""
