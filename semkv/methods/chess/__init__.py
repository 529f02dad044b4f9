"""CHESS: hierarchical Grid -> Chunk -> Page selection by key-key affinity, zero-copy page selection and
uncertainty-triggered re-selection.

method.py (the method), cascade.py (the Grid -> Chunk -> Page cascade), uncertainty.py (entropy
triggers), kernels.py / reference.py / triton_summary_dot.py (summary dot products)."""
from semkv.methods.chess.method import Chess

__all__ = ["Chess"]
