"""``dllm playground``: watch two methods decode the same message side by side (Gradio; the
``ui`` extra). ``canvas`` renders a pane from a run's trace; ``app`` builds the Gradio page."""
