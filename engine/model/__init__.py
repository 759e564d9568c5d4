"""The model: its runner (the core's one way to it), loading, its stages, the direct decode step."""
