"""Position-free span keys, span compilation and assembly at new positions, selective recomputation."""
