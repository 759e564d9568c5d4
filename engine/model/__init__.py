"""The model: loading Qwen3-VL, its stages (encode, prefill, decode), the decode backend and the tests' tiny model."""
