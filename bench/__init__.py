"""vlscope's measuring commands, beside the engine and never inside it: the benchmark sweep (`python -m bench`), the
implementation trials (`python -m bench.tune`), the load and fault run (`python -m bench.soak`) and the peers'
runners. They use the engine as any caller would; what the pages show of speed lives in speed/."""
