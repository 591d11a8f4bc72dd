"""The bottom layer: types, the tenant, errors, config, the tokenizer, prompt rendering, the request
plan and the one planner, the engine protocol, model preparation. Imports nothing of contextkit above
it (only ``contextkit.kernels``, which imports nothing of contextkit); pinned by import-linter."""
