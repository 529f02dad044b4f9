"""H2O: heavy-hitter eviction by accumulated attention.

method.py (the method), kernels.py / reference.py / triton_attention_scores.py (prompt and decode attention
sums)."""
from semkv.methods.h2o.method import H2O

__all__ = ["H2O"]
