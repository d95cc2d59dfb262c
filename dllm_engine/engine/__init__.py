"""Engine: sequences, KV cache, runner, the step loop and the offline API."""
