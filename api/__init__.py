"""vlscope's HTTP API: OpenAI-compatible chat completions served beside the UI, over the same engine."""
