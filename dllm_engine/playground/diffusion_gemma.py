"""A playground pane for a uniform-noise canvas family (DiffusionGemma; ``engine/canvas_llm.py``),
without Gradio: the run with its ``CanvasStep`` trace (``CanvasPaneRun``) and the pane at a step
as HTML (``canvas_pane_html``). Nothing is masked here: every step redraws the current canvas,
keeps its lowest-entropy draws (shown green) and puts fresh random tokens everywhere else (shown
grey); a canvas that stops keeps its argmax (shown blue), and the next canvas starts as noise.
The replay clock and the page are the masked families' (``canvas.timeline``, ``app``)."""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from ..engine.canvas_llm import METHOD, CanvasLLM, CanvasParams, parse_canvas_spec
from .canvas import RecordedRun, answer_message, token_label

LEGEND = ('<span class="slot mask">\u00b7</span> not drawn yet · <span class="slot tok noise">w</span> '
          'noise (a draw not accepted, renoised) · <span class="slot tok acc">w</span> accepted this step · '
          '<span class="slot tok kept">w</span> kept (the canvas stopped: its argmax)')

CSS = """
.slot.noise { background: #eeeeee; color: #888; font-style: italic; }
.slot.acc { background: hsl(140, 60%, 80%); }
.slot.kept { background: hsl(210, 70%, 86%); }
"""


def default_canvas_methods(llm: CanvasLLM) -> tuple[str, str]:
    """The sampler with the checkpoint's own settings beside it with half the denoising steps
    per canvas: what fewer steps cost in the text."""
    steps = llm.settings.max_denoising_steps
    return METHOD, f"{METHOD}:steps={max(1, steps // 2)}"


def canvas_pane_params(llm: CanvasLLM, spec: str, max_new_tokens: int | None = None) -> CanvasParams:
    """``spec`` (``diffusion-gemma[:field=value,...]``: ``parse_canvas_spec``) resolved for
    ``llm``, recording steps; a ``UserError`` naming what is wrong."""
    given = {"max_new_tokens": int(max_new_tokens)} if max_new_tokens else {}
    return llm.resolve(parse_canvas_spec(spec, **given).replace(record_steps=True))


@dataclass
class CanvasPaneRun(RecordedRun):
    """A canvas model's pane run (``CanvasStep`` steps, one per denoising step) and each
    canvas's kept argmax."""
    kept: dict[int, list[int]] = field(default_factory=dict)  # canvas -> its last step's argmax
    last_step: dict[int, int] = field(default_factory=dict)  # canvas -> the index of its last step
    texts: dict[int, str] = field(default_factory=dict)  # token id -> its text, for every token shown

    def __post_init__(self) -> None:
        for i, s in enumerate(self.steps):
            self.kept[s.canvas], self.last_step[s.canvas] = s.argmax_ids, i

    def canvases_at(self, at: int) -> list[tuple[list[int], str, list[bool]]]:
        """The canvases after step ``at`` (-1: before the first step), each as (token ids, its
        state: ``kept`` or ``drawing``, which positions hold an accepted draw)."""
        if at < 0:
            return []
        record = self.steps[at]
        shown = [(self.kept[c], "kept", [True] * len(self.kept[c])) for c in range(record.canvas)]
        if self.last_step[record.canvas] == at:
            return shown + [(self.kept[record.canvas], "kept", [True] * len(record.argmax_ids))]
        return shown + [(record.token_ids, "drawing", record.accepted)]

    def answer_tokens(self, at: int) -> int:
        """The answer's tokens the kept canvases hold after step ``at`` (up to the first stop)."""
        count = 0
        for ids, state, _ in self.canvases_at(at):
            if state != "kept":
                break
            for t in ids:
                if t in self.stop_ids:
                    return count
                count += 1
        return min(count, self.params.max_new_tokens)


def run_canvas_pane(llm: CanvasLLM, spec: str, params: CanvasParams, message: str, chat: bool) -> CanvasPaneRun:
    """Generate ``message`` (as a one-turn chat when ``chat``) with ``params`` (recording steps)."""
    run = CanvasPaneRun(spec, params, answer_message(llm, params, message, chat), llm.stop_ids(params))
    if llm.tokenizer is not None:
        shown = {t for s in run.steps for t in (*s.token_ids, *s.argmax_ids)}
        run.texts = {t: llm.tokenizer.decode([t], skip_special_tokens=False) for t in shown}
    return run


def canvas_stats_line(run: CanvasPaneRun, at: int) -> str:
    """The step, the accepted draws, nfe (decoder steps and encoder passes) and tok/s after step ``at``."""
    if at < 0:
        return "nfe 0"
    record = run.steps[at]
    nfe = at + 1 + record.canvas + 1  # the steps so far, the prompt's encoder pass, one per later canvas
    seconds = record.seconds
    answer = run.answer_tokens(at)
    return (f"canvas {record.canvas + 1} step {record.step + 1} · {sum(record.accepted)}/{len(record.accepted)} "
            f"accepted · nfe {nfe} · {answer / seconds if seconds else 0:.0f} tok/s")


def canvas_pane_html(run: CanvasPaneRun, at: int, label: str) -> str:
    """The pane after step ``at`` (-1: before the first step): stats line and canvases."""
    done = at == len(run.steps) - 1
    canvases = run.canvases_at(at)
    slots = []
    for c, (ids, state, accepted) in enumerate(canvases):
        for i, (tok, ok) in enumerate(zip(ids, accepted)):
            label_text, extra = token_label(run, tok, run.texts.get(tok))
            css = "kept" if state == "kept" else ("acc" if ok else "noise")
            what = {"kept": "kept", "acc": "accepted", "noise": "noise"}[css]
            slots.append(f'<span class="slot tok {css}{extra}" data-canvas="{c}" data-pos="{i}" data-tok="{tok}" '
                         f'title="canvas {c}, slot {i}: {what}">{html.escape(label_text)}</span>')
    if not canvases:
        slots = ['<span class="slot mask">\u00b7</span>'] * run.params.canvas_length
    status = "finished" if done else f"step {at + 1} of {len(run.steps)}"
    return (f'<div class="dllm-pane" data-pane="{label}" data-done="{str(done).lower()}" data-step="{at}">'
            f'<div class="dllm-head"><b>{label}</b> <code>{html.escape(run.spec)}</code> · {status}</div>'
            f'<div class="dllm-stats">{canvas_stats_line(run, at)}</div>'
            f'<div class="dllm-canvas">{"".join(slots)}</div></div>')
