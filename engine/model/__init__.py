"""The model: its runner (the core's one way to it), loading Qwen3-VL, its stages, the direct decode step and the decode
backend, and the tests' tiny model."""
