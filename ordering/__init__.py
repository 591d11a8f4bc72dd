"""Evidence ordering for prefix caches: prefix tree over served sequences (tree.py), greedy walk and
oracle (weaver.py), block-aligned rendering (align.py). Touches no tensors."""

from contextkit.ordering.weaver import Doc, OrderResult, Weaver, oracle

__all__ = ["Doc", "OrderResult", "Weaver", "oracle"]
