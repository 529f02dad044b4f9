"""Host-side store of offloaded K/V for methods that keep most of the cache off the device (SentenceKV, DynSplit-KV).

Per sequence and layer it holds keys, values and original positions `[kv_heads, n, D]` in host memory (pinned when
the device is a GPU, so copies can be asynchronous) and counts every byte moved each way. On a CPU-only run the
"device" is the host: the same calls run and gather, but nothing crosses a bus (bytes are still counted as the
traffic a GPU run would have).
"""
from __future__ import annotations

import torch


class HostKVStore:
    def __init__(self, num_layers: int, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self.k: list[torch.Tensor | None] = [None] * num_layers  # [kv_heads, n, D] on the host
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.pos: list[torch.Tensor | None] = [None] * num_layers  # [kv_heads, n] int32
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    def size(self, layer: int) -> int:
        return 0 if self.k[layer] is None else self.k[layer].shape[1]

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append tokens (device tensors [kv_heads, m, D], positions [kv_heads, m]) to the layer's host store."""
        host = [t.to("cpu") for t in (k, v, pos.to(torch.int32))]
        self.d2h_bytes += (k.numel() + v.numel()) * k.element_size()
        old = (self.k[layer], self.v[layer], self.pos[layer])
        if old[0] is not None:
            host = [torch.cat([o, h], dim=1) for o, h in zip(old, host)]
        if self.pin:
            host = [h.pin_memory() for h in host]
        self.k[layer], self.v[layer], self.pos[layer] = host

    def fetch(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """index [kv_heads or 1, m] into the layer's store -> keys, values [kv_heads, m, D] and positions
        [kv_heads, m] on the device."""
        index = index.to("cpu")
        heads = self.k[layer].shape[0]
        if index.shape[0] == 1:
            index = index.expand(heads, -1)
        rows = torch.arange(heads)[:, None]
        k, v, pos = self.k[layer][rows, index], self.v[layer][rows, index], self.pos[layer][rows, index]
        self.h2d_bytes += (k.numel() + v.numel()) * k.element_size()
        if self.pin:
            k, v = k.pin_memory(), v.pin_memory()
        non_blocking = self.device.type == "cuda"
        return (k.to(self.device, non_blocking=non_blocking), v.to(self.device, non_blocking=non_blocking),
                pos.to(self.device, non_blocking=non_blocking))

    def nbytes(self) -> int:
        """Host bytes held (keys and values)."""
        return sum(0 if k is None else 2 * k.numel() * k.element_size() for k in self.k)
