"""Accelerations, one file each, entering the engine through ``base.Strategy``'s hooks.

What a method string may say about them (names, bases, options, which combine) is plain data in
``dllm_engine.methods.STRATEGIES``; this package init imports nothing, so reading that data never
loads a runtime class."""
