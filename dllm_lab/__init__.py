"""The lab beside the engine: what made the embedded checkpoints and studies them.

``dllm_lab.train`` trains the tiny checkpoints from the task suite; ``dllm_lab.probes`` asks
them questions (do worked answers compute each intermediate result, is the decoding frontier
the slot a threshold decoder commits first, which step loses a phrased answer); ``dllm_lab.cli``
registers their ``dllm`` subcommands (``train``, ``canvas-rows``, ``chain-probe``,
``frontier-probe``, ``canvas-probe``) through the ``dllm.commands`` entry point. The lab imports
the engine (``dllm_engine``); the engine never imports the lab (``tests/test_imports.py``)."""
