"""Bridges to other tools (optional extras): ``lm_eval`` (the lm-evaluation-harness model ``dllm``;
the task suite as lm-eval YAML tasks is the lab's, ``dllm_lab.lm_eval_tasks``)."""
