"""Hot loops on KV tensors: RoPE (reference in ``rope.py``). Imports nothing above torch."""
