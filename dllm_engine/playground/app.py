"""The Gradio page of ``dllm playground``: a message box, two panes each running one method spec.

On Send, each pane's method generates the message once with ``record_steps`` (A, then B, one
engine), then the page replays both recorded traces on one clock: the canvases animate as they
were decoded (the step times are the real ones, slowed down so the slower run lasts the replay
length), then the final speed-up. The animation is a replay of the trace after the generation,
as LLaDA's and Fast-dLLM's demos effectively show theirs. A uniform-noise canvas model
(DiffusionGemma) gets its own panes (``playground/diffusion_gemma.py``: each step's redrawn canvas,
its accepted draws, the canvases kept), on the same clock. Every error (a bad spec, a method the
model cannot run, a prompt it refuses) is shown in the page; nothing is raised to Gradio."""
from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Iterator

import gradio as gr

from ..engine.canvas_llm import CanvasLLM
from ..engine.llm import LLM
from . import diffusion_gemma as noise
from .canvas import (CSS, LEGEND, PaneRun, default_methods, empty_html, error_html, pane_html, pane_params,
                     run_pane, speedup_text, timeline)

LABELS = ("A", "B")
REPLAY_SECONDS = 5.0
Outputs = tuple  # (pane A html, pane B html, A's text, B's text, summary, A's trace, B's trace)


def example_prompts(path: str | Path | None = None) -> list[str]:
    """The page's example messages: a prompts file's (``bench/prompts.py``; a conversation line
    gives its last message), else the default dataset's showcase (held-out prompts of the task
    suite the embedded checkpoints were trained on), else none."""
    if path is not None:
        from ..bench.prompts import load_prompts
        return [e.chat()[-1]["content"] for e in load_prompts(path)]
    from .. import datasets
    showcase = datasets.registered().get(datasets.DEFAULT)
    return [e.prompt for e in showcase.showcase()] if showcase and showcase.showcase else []


class Playground:
    """The page's state: one model, its default specs; ``send`` is the Send button's handler."""

    def __init__(self, llm: LLM | CanvasLLM, methods: tuple[str, str] | None = None) -> None:
        self.llm = llm
        self.uniform_noise = isinstance(llm, CanvasLLM)
        defaults = noise.default_canvas_methods if self.uniform_noise else default_methods
        self.pane_params = noise.canvas_pane_params if self.uniform_noise else pane_params
        self.run_pane = noise.run_canvas_pane if self.uniform_noise else run_pane
        self.pane_html = noise.canvas_pane_html if self.uniform_noise else pane_html
        self.methods = tuple(methods) if methods else defaults(llm)
        self.has_chat = bool(llm.tokenizer is not None and getattr(llm.tokenizer, "chat_template", None))

    def warm_up(self) -> None:
        """One short generation per default spec, so the first message's timings are not the
        engine's first-call costs; a failure here shows again, in the page, on Send."""
        for spec in self.methods:
            try:
                params = self.pane_params(self.llm, spec)
                self.run_pane(self.llm, spec, params.replace(max_new_tokens=params.block_length), "warm up", self.has_chat)
            except Exception:
                pass

    def send(self, message: str, spec_a: str, spec_b: str, replay_seconds: float = REPLAY_SECONDS,
             chat: bool = True, max_new_tokens: float | None = None) -> Iterator[Outputs]:
        """Generate with both specs, then stream the replay frames; errors become page text."""
        specs = (spec_a or "", spec_b or "")
        try:
            runs = self.generate(message, specs, chat, max_new_tokens)
        except PaneError as e:
            yield self.failed(specs, e.pane, str(e.__cause__ or e))
            return
        try:
            yield from self.replay(runs, float(replay_seconds or 0))
        except Exception as e:  # a rendering bug: say it in the page, not as a traceback
            yield self.failed(specs, None, f"{type(e).__name__}: {e}")

    def generate(self, message: str, specs: tuple[str, str], chat: bool, max_new_tokens: float | None
                 ) -> list[PaneRun]:
        """Both panes' runs; every spec is checked before either runs."""
        if not message or not message.strip():
            raise PaneError(None, "type a message first")
        params = []
        for label, spec in zip(LABELS, specs):
            try:
                params.append(self.pane_params(self.llm, spec, max_new_tokens))
            except Exception as e:
                raise PaneError(label, str(e)) from e
        runs = []
        for label, spec, p in zip(LABELS, specs, params):
            try:
                runs.append(self.run_pane(self.llm, spec.strip(), p, message, chat and self.has_chat))
            except Exception as e:
                raise PaneError(label, str(e)) from e
        return runs

    def replay(self, runs: list[PaneRun], replay_seconds: float) -> Iterator[Outputs]:
        frames = timeline(runs, replay_seconds)
        note = (f"Replaying the recorded traces on one clock, slowed to {replay_seconds:g} s."
                if replay_seconds else "Replaying the recorded traces step by step.")
        for at, wait in frames[:-1]:
            time.sleep(wait)
            yield (*[self.pane_html(r, k, label) for r, k, label in zip(runs, at, LABELS)], "", "", note, None, None)
        time.sleep(frames[-1][1])
        final = [self.pane_html(r, len(r.steps) - 1, label) for r, label in zip(runs, LABELS)]
        traces = [{"spec": r.spec, "method": r.params.describe(), "prompt_len": r.prompt_len,
                   "steps": [s.as_dict() for s in r.steps]} for r in runs]
        yield (*final, runs[0].output.text, runs[1].output.text, speedup_text(runs), *traces)

    def failed(self, specs: tuple[str, str], pane: str | None, message: str) -> Outputs:
        """Outputs for an error: the pane at fault (or the summary) says what went wrong."""
        panes = [error_html(label, spec, message) if label == pane else empty_html(label, spec)
                 for label, spec in zip(LABELS, specs)]
        where = f"Pane {pane}: " if pane else ""
        return (*panes, "", "", f"**Error.** {where}{message}", None, None)


class PaneError(Exception):
    """A pane's spec or run failed (``pane``: A, B, or None for the message itself)."""

    def __init__(self, pane: str | None, message: str) -> None:
        super().__init__(message)
        self.pane = pane


def build_app(llm: LLM | CanvasLLM, methods: tuple[str, str] | None = None, warm_up: bool = False,
              examples: list[str] | None = None) -> gr.Blocks:
    """The page for ``llm``, its panes running ``methods`` (default: ``default_methods``), with
    ``examples`` as its example messages (default: ``example_prompts()``)."""
    pg = Playground(llm, methods)
    if warm_up:
        pg.warm_up()
    with gr.Blocks(title="dllm-engine playground") as demo:
        gr.Markdown(f"## dllm-engine playground\nModel `{llm.name}` ({llm.model_type}). "
                    "Each pane decodes your message with its method; the canvases then replay the "
                    "recorded traces (docs/playground.md, docs/traces.md).")
        gr.HTML(f'<div class="dllm-pane">{noise.LEGEND if pg.uniform_noise else LEGEND}</div>')
        with gr.Row():
            message = gr.Textbox(label="Message", placeholder="type a message and press Send", scale=5,
                                 elem_id="message")
            send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
        with gr.Row():
            spec_a = gr.Textbox(pg.methods[0], label="Pane A: method spec", elem_id="spec-a")
            spec_b = gr.Textbox(pg.methods[1], label="Pane B: method spec", elem_id="spec-b")
        with gr.Accordion("Options", open=False):
            replay = gr.Slider(0, 30, value=REPLAY_SECONDS, step=0.5, label="replay seconds (0: step by step)")
            chat = gr.Checkbox(pg.has_chat, label="apply the chat template", interactive=pg.has_chat)
            max_new = gr.Number(None, label="max new tokens (empty: the model's default)", precision=0)
        summary = gr.Markdown(elem_id="summary")
        with gr.Row():
            with gr.Column():
                pane_a = gr.HTML(empty_html("A", pg.methods[0]), elem_id="pane-a")
                text_a = gr.Textbox(label="A's answer", interactive=False, elem_id="text-a")
            with gr.Column():
                pane_b = gr.HTML(empty_html("B", pg.methods[1]), elem_id="pane-b")
                text_b = gr.Textbox(label="B's answer", interactive=False, elem_id="text-b")
        with gr.Accordion("Traces (JSON, docs/traces.md)", open=False):
            trace_a, trace_b = gr.JSON(label="A"), gr.JSON(label="B")
        shown = examples or example_prompts()
        if shown:  # none without a prompts file or the lab's task suite
            gr.Examples(shown, inputs=message)
        inputs = [message, spec_a, spec_b, replay, chat, max_new]
        outputs = [pane_a, pane_b, text_a, text_b, summary, trace_a, trace_b]
        send.click(pg.send, inputs, outputs, api_name="send")
        message.submit(pg.send, inputs, outputs, api_name=False)
    return demo


def launch(demo: gr.Blocks, host: str = "127.0.0.1", port: int = 7860, share: bool = False,
           block: bool = True) -> str:
    """Serve ``demo``; returns its local URL (``block``: serve until interrupted)."""
    demo.queue(default_concurrency_limit=1)  # one engine: one generation at a time
    _, url, _ = demo.launch(server_name=host, server_port=port, share=share, prevent_thread_lock=True,
                            quiet=True, css=CSS + noise.CSS, ssr_mode=False, footer_links=[])
    if block:
        demo.block_thread()
    return url
