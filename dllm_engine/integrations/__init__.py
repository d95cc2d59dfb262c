"""Bridges to other tools (optional extras): ``lm_eval`` (the lm-evaluation-harness model ``dllm``)
and ``lm_eval_tasks`` (the embedded task suite as lm-eval YAML tasks)."""
