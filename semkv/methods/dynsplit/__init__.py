"""DynSplit-KV: delimiter-based semantic splitting (DD-Select) and variable-to-fixed block mapping (V2F).

method.py (the method), split.py (delimiters, Algorithm 1, DD-Select), v2f.py (chunk summaries, scores,
per-sequence state), rows.py (batched device state), offload.py (host offload), kernels.py / reference.py /
triton_*.py (chunk slots, chunk refresh, slot stamps)."""
from semkv.methods.dynsplit.method import DynSplitKV

__all__ = ["DynSplitKV"]
