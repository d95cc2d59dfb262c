"""The lab beside the engine: what made the embedded checkpoints and studies them.

``dllm_lab.tasks`` is the task suite they were trained on (generators, the committed held-out
split, graders), registered with the engine as its dataset ``tasks`` (``dllm_engine.datasets``);
``dllm_lab.tokenizer`` builds their word-level tokenizer; ``dllm_lab.train`` trains them;
``dllm_lab.probes`` asks them questions (do worked answers compute each intermediate result, is
the decoding frontier the slot a threshold decoder commits first, which step loses a phrased
answer); ``dllm_lab.lm_eval_tasks`` writes the split as lm-eval tasks. ``dllm_lab.cli`` registers
their ``dllm`` subcommands (``eval``, ``lm-eval-tasks``, ``train``, ``canvas-rows``,
``chain-probe``, ``frontier-probe``, ``canvas-probe``) through the ``dllm.commands`` entry point.
The lab imports the engine (``dllm_engine``); the engine never imports the lab
(``tests/test_imports.py``)."""
