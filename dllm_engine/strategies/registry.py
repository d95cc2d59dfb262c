"""Strategy names as used in ``method`` strings -> "module:Class" (imported on first use)."""

REGISTRY: dict[str, str] = {
    "focus": "dllm_engine.strategies.focus:TokenEviction",
    "focus-probe": "dllm_engine.strategies.focus:PredictorProbe",  # diagnostic
    "delayed-cache": "dllm_engine.strategies.focus:DelayedCache",  # FOCUS's ablation: no eviction
    "early-skip": "dllm_engine.strategies.early_skip:EarlySkip",
    "adaptive-length": "dllm_engine.strategies.adaptive_length:AdaptiveLength",
    "jump-share": "dllm_engine.strategies.jump_share:JumpShare",
}
