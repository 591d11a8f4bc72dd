"""Where KV lives: memory, disk and LMCache-backed tiers, integrity checks, metrics. Knows nothing of spans."""
