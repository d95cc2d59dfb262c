"""Probes of the embedded checkpoints (``dllm chain-probe``, ``frontier-probe``, ``canvas-probe``)."""
