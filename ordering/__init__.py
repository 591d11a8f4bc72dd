"""Evidence ordering for prefix caches: prefix tree over served sequences (tree.py), greedy walk and
oracle (weaver.py). Touches no tensors. ``Weaver`` implements ``contextkit.core.planner.Orderer``."""

from contextkit.core.types import Doc, OrderResult
from contextkit.ordering.weaver import Weaver, oracle

__all__ = ["Doc", "OrderResult", "Weaver", "oracle"]
