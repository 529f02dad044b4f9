"""Host-side store of offloaded K/V for methods that keep most of the cache off the device (SentenceKV, DynSplit-KV).

One store holds one sequence's offloaded tokens, every layer: keys and values `[layers, kv_heads, capacity, D]` and
original positions `[layers, kv_heads, capacity]`, numbered 0.. per layer in the order they were put. The capacity is
fixed when the store is made (what the request can offload over its whole generation), so the buffers never move: on
a GPU they are pinned, and a kernel reads them in place through their addresses (`pointers`; with unified virtual
addressing a pinned host address is also a device address). That read is the only host-to-device traffic, and the
kernel counts it. On a CPU-only run the "device" is the host: the same calls run, nothing crosses a bus.
"""
from __future__ import annotations

import math
import weakref

import torch

from semkv import kernels
from semkv.engine.memory import HostMemory
from semkv.errors import SemkvError


def grown_capacity(need: int, minimum: int) -> int:
    """Room for a buffer that must hold `need` entries: an eighth more (at least `minimum`), so appends are amortised
    and the slack stays bounded."""
    return need + max(minimum, need // 8)


HOST_PAGE = 4096  # host memory is pinned a page at a time


class HostKVStore(HostMemory):
    def __init__(self, layers: int, kv_heads: int, dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device):
        self.capacity = capacity
        shapes = ((layers, kv_heads, capacity, dim), (layers, kv_heads, capacity, dim), (layers, kv_heads, capacity))
        dtypes = (dtype, dtype, torch.int32)
        sizes = [math.prod(shape) * torch.empty((), dtype=d).element_size() for shape, d in zip(shapes, dtypes)]
        total = -(-sum(sizes) // HOST_PAGE) * HOST_PAGE
        # one buffer, page-aligned: on a GPU it is pinned in place (`cudaHostRegister`), so it takes exactly its size
        # (the pinned caching allocator would round it up to a power of two) and is unpinned when the store goes
        with torch.inference_mode(False):  # normal tensors: written between steps, outside inference mode too
            self.buffer = torch.empty(total + HOST_PAGE, dtype=torch.uint8)
            start = -self.buffer.data_ptr() % HOST_PAGE
            views = []
            for shape, d, size in zip(shapes, dtypes, sizes):
                views.append(self.buffer[start : start + size].view(d).view(shape))
                start += size
        self.k, self.v, self.pos = views  # [layers, kv_heads, capacity, D] x 2, [layers, kv_heads, capacity]
        if device.type == "cuda":
            address = self.buffer.data_ptr() + (-self.buffer.data_ptr() % HOST_PAGE)
            pin(address, total)
            weakref.finalize(self, unpin, self.buffer, address)  # the buffer lives until it is unpinned
        self.count = [0] * layers  # tokens held per layer
        self.d2h_bytes = 0

    def size(self, layer: int) -> int:
        return self.count[layer]

    def put(self, layers: slice, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Append tokens to `layers` (each holding as many): keys and values [L', kv_heads, m, D], positions
        [L', kv_heads, m], on the device. On a GPU the device writes them into the pinned buffers in stream order,
        without the host waiting (`kernels.put_host`): the kernels that read them later run after it."""
        counts = set(self.count[layers])
        n, m = counts.pop(), k.shape[2]
        if counts or n + m > self.capacity:
            raise SemkvError(f"host KV store: {m} more tokens do not fit layers {layers} (held {self.count[layers]}, "
                             f"capacity {self.capacity})")
        kernels.put_host(k, v, pos, self.k, self.v, self.pos, range(len(self.count))[layers].start, n)
        for layer in range(*layers.indices(len(self.count))):
            self.count[layer] = n + m
        self.d2h_bytes += (k.numel() + v.numel()) * k.element_size()

    def pointers(self) -> list[int]:
        """The buffers' addresses (keys, values, positions) and the capacity, as a kernel reads them."""
        return [self.k.data_ptr(), self.v.data_ptr(), self.pos.data_ptr(), self.capacity]


def available_host_bytes() -> float:
    """Host memory the system can still give (`MemAvailable` of /proc/meminfo), unbounded where it is not known."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return math.inf


def token_bytes(kv_heads: int, dim: int, dtype: torch.dtype) -> int:
    """Host bytes of one offloaded token of one layer: keys, values and positions of every KV head."""
    return kv_heads * (2 * dim * torch.empty((), dtype=dtype).element_size() + 4)


def pin(address: int, size: int) -> None:
    """Pin `size` bytes of host memory at a page-aligned address for the GPU, in place. With unified virtual
    addressing a kernel then reads them at their host address."""
    error = torch.cuda.cudart().cudaHostRegister(address, size, 0)
    if int(error) != 0:
        raise SemkvError(f"cannot pin {size / 2**30:.2f} GiB of host memory for offloaded K/V (CUDA error "
                         f"{int(error)}); free host memory or lower the batch")


def unpin(buffer: torch.Tensor, address: int) -> None:
    """Undo `pin` (the buffer is freed once this returns), after the device's writes into it (`put`) are done."""
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(address)
