"""SentenceKV: sentence buckets, observation-window pre-filter, CPU offload and mean-query sentence retrieval.

method.py (the method), sentences.py and vocab.py (sentence boundaries), buckets.py (sentence state and
device rows), kernels.py / reference.py / triton_sentence_slots.py (slot lists from ranked buckets)."""
from semkv.methods.sentencekv.method import SentenceKV

__all__ = ["SentenceKV"]
