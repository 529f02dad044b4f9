"""TokenSelect: token-level per-head criticality, head soft vote, Selection Cache, paged dot-product kernel
and length extrapolation.

method.py (the method), kernels.py / reference.py / triton_token_select.py (the
batched selection with its Selection Cache)."""
from semkv.methods.tokenselect.method import TokenSelect

__all__ = ["TokenSelect"]
