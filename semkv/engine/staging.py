"""Small copies between host and device that do not wait for the device: to the device, integers (a decode step's
inputs, new page ids) through `HostStaging`; to the host, a step's results through `copy_early`.

A ring of pinned host memory is filled through its numpy view and copied from with `non_blocking=True`, so the host
neither allocates nor pins memory per copy (PyTorch's pinning path costs ~0.1 ms a call) nor waits for kernels in
flight. A region is written again only after the ring wrapped, and wrapping waits for the device once, so no copy can
still be reading it. Off CUDA, values become a fresh tensor.
"""
from __future__ import annotations

import numpy as np
import torch


class HostStaging:
    def __init__(self, device: torch.device, capacity: int = 1 << 20):
        """capacity: int64 values the ring holds (8 MiB by default: hundreds of decode steps between waits)."""
        self.device = device
        self.pinned = device.type == "cuda"
        self.buffer = torch.empty(capacity if self.pinned else 0, dtype=torch.long, pin_memory=self.pinned)
        self.array = self.buffer.numpy()
        self.offset = 0

    def send(self, values) -> torch.Tensor:
        """values: an int array or (nested) list of ints -> an int64 tensor of its shape on the device."""
        data = np.asarray(values, dtype=np.int64)
        if not self.pinned:
            return torch.from_numpy(data.copy()).to(self.device)
        n = data.size
        if n > self.array.size:
            return torch.from_numpy(data).pin_memory().to(self.device, non_blocking=True)
        if self.offset + n > self.array.size:  # wrap: every copy from the ring so far must have finished
            torch.cuda.synchronize(self.device)
            self.offset = 0
        region = slice(self.offset, self.offset + n)
        self.array[region] = data.ravel()
        self.offset += n
        return self.buffer[region].view(data.shape).to(self.device, non_blocking=True)


def copy_early(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Device values copied into pinned host memory without waiting, and an event recorded after the copy: read them
    once `ready.synchronize()` returns, which waits for this copy only (off CUDA: the values, and None)."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
