"""InfLLM: block memory with representative keys, initial tokens and a local window.

method.py (the method), kernels.py / reference.py / triton_block_slots.py (slot lists from chosen blocks)."""
from semkv.methods.infllm.method import InfLLM

__all__ = ["InfLLM"]
