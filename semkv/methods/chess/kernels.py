"""chess's kernels: Triton on CUDA, the torch reference (`reference.py` beside this file) elsewhere."""
from __future__ import annotations

from semkv.kernels import use_triton
from semkv.methods.chess import reference


def summary_dots(sums, pages, directions):
    """See `reference.summary_dots`."""
    if use_triton(sums.device):
        from semkv.methods.chess import triton_summary_dot

        return triton_summary_dot.summary_dots(sums, pages, directions)
    return reference.summary_dots(sums, pages, directions)
