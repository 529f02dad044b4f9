"""Host-side store of offloaded K/V for methods that keep most of the cache off the device (SentenceKV, DynSplit-KV).

Per sequence and layer it holds keys, values and original positions `[kv_heads, n, D]` in host memory (pinned when
the device is a GPU, so copies can be asynchronous) and counts every byte moved each way. On a CPU-only run the
"device" is the host: the same calls run and gather, but nothing crosses a bus (bytes are still counted as the
traffic a GPU run would have).
"""
from __future__ import annotations

import torch

from semkv.engine.memory import HostMemory


def grown_capacity(need: int, minimum: int) -> int:
    """Room for a buffer that must hold `need` entries: an eighth more (at least `minimum`), so appends are amortised
    and the slack stays bounded."""
    return need + max(minimum, need // 8)


class HostKVStore(HostMemory):
    def __init__(self, num_layers: int, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        # per layer, buffers with room to grow (the first `size(layer)` tokens are held): keys and values
        # [kv_heads, capacity, D], positions [kv_heads, capacity] int32, on the host
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.pos: list[torch.Tensor | None] = [None] * num_layers
        self.count = [0] * num_layers
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def size(self, layer: int) -> int:
        return self.count[layer]

    def _reserve(self, layer: int, k: torch.Tensor, need: int) -> None:
        """Room for `need` tokens (`grown_capacity`)."""
        have = 0 if self.k[layer] is None else self.k[layer].shape[1]
        if need <= have:
            return
        capacity = grown_capacity(need, 256)
        heads, dim, n = k.shape[0], k.shape[2], self.count[layer]
        grown = [torch.empty(heads, capacity, *rest, dtype=dtype, pin_memory=self.pin)
                 for rest, dtype in (((dim,), k.dtype), ((dim,), k.dtype), ((), torch.int32))]
        for new, old in zip(grown, (self.k[layer], self.v[layer], self.pos[layer])):
            if old is not None:
                new[:, :n] = old[:, :n]
        self.k[layer], self.v[layer], self.pos[layer] = grown

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append tokens (device tensors [kv_heads, m, D], positions [kv_heads, m]) to the layer's host store."""
        n, m = self.count[layer], k.shape[1]
        self._reserve(layer, k, n + m)
        self.k[layer][:, n : n + m] = k
        self.v[layer][:, n : n + m] = v
        self.pos[layer][:, n : n + m] = pos
        self.count[layer] = n + m
        self.d2h_bytes += (k.numel() + v.numel()) * k.element_size()

    def fetch(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """index [kv_heads or 1, m] into the layer's store -> keys, values [kv_heads, m, D] and positions
        [kv_heads, m] on the device. The rows are gathered on the host by `index_select` straight into pinned
        buffers (whole rows at a time, no second copy to pin them), which the device then copies asynchronously;
        the host allocator keeps a buffer until its copy is done."""
        index = index.to("cpu")
        heads, capacity, dim = self.k[layer].shape
        flat = (torch.arange(heads)[:, None] * capacity + index).flatten()  # [kv_heads * m] rows of the store
        m = flat.shape[0] // heads
        gathered = []
        for store, row_shape in ((self.k[layer], (dim,)), (self.v[layer], (dim,)), (self.pos[layer], ())):
            out = torch.empty(flat.shape[0], *row_shape, dtype=store.dtype, pin_memory=self.pin)
            torch.index_select(store.view(heads * capacity, *row_shape), 0, flat, out=out)
            gathered.append(out.view(heads, m, *row_shape).to(self.device, non_blocking=self.pin))
        k, v, pos = gathered
        self.h2d_bytes += (k.numel() + v.numel()) * k.element_size()
        return k, v, pos

    def nbytes(self) -> int:
        """Host bytes held (keys and values)."""
        return sum(2 * n * k.shape[0] * k.shape[2] * k.element_size() for n, k in zip(self.count, self.k) if n)
