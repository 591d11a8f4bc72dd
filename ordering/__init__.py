"""Evidence ordering for prefix caches: prefix tree over served sequences (tree.py), greedy walk and
oracle (weaver.py). Touches no tensors."""
