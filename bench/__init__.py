"""vlscope's measuring tools, beside the engine and never inside it: the benchmark sweep (`python -m bench`), the
precision advisor, the implementation trials (`python -m bench.tune`) and the load and fault run
(`python -m bench.soak`). They use the engine as any caller would."""
