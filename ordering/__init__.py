"""Evidence ordering for prefix caches (prefix tree over served sequences, greedy walk, oracle). Touches no tensors."""
