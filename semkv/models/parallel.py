"""Tensor parallelism over the GPUs of one host, Megatron-style: rank r of N holds 1/N of the attention heads (q/k/v
rows of its heads, the matching o_proj columns) and 1/N of the MLP (gate/up rows, down columns). After o_proj and
down_proj the ranks' partial sums are added (`all_reduce`), so every rank carries the whole hidden state; embeddings,
norms and the LM head are whole on every rank. Each rank's KV cache holds its own KV heads only: a rank's
`ModelConfig` (`local_config`) counts its heads, so the engine and the methods work per rank unchanged, and a
method whose choice is shared by the heads of a layer adds its scores over the ranks (`reduce`) before choosing.

The processes themselves are started by `semkv.launch`; this module only needs their process groups.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from semkv.errors import SemkvError

@dataclass(eq=False)
class TensorParallel:
    """This process's place among the ranks: `group` carries tensors (NCCL on GPUs, gloo on the CPU), `host` Python
    objects and host-side numbers (gloo)."""

    rank: int
    size: int
    group: Any
    host: Any

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """x summed (op "sum") or maximised ("max") over the ranks, in place; returned for chaining."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (e.g. the tokens its sampler chose)."""
        dist.broadcast(x, 0, group=self.group)
        return x

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's Python object on every rank (the others pass anything)."""
        box = [obj]
        dist.broadcast_object_list(box, 0, group=self.host)
        return box[0]

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's Python object, by rank."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.host)
        return out

    def abort(self) -> None:
        """Leave the process groups at once, without waiting for the other ranks: NCCL's collectives in flight here
        return (their communicators are aborted) and the process may join a new group."""
        dist.distributed_c10d._abort_process_group()

    def host_min(self, value: float) -> float:
        """The smallest of the ranks' values of a host-side number (so that every rank takes the same decision)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host)
        return float(t)


def reduce(tp: TensorParallel | None, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """x summed (or with op "max" maximised) over the ranks (a partial result of each rank's heads). Without tensor
    parallelism, x itself."""
    return x if tp is None else tp.all_reduce(x, op)


def over_heads(tp: TensorParallel | None, x: torch.Tensor, dim: int, op: str = "mean",
               keepdim: bool = False) -> torch.Tensor:
    """x reduced over its dimension of heads (op: mean, sum or max), every rank's heads included: what a score that a
    layer's heads share is made of. The ranks hold equal shares of the heads, so the mean is the mean of the ranks'
    means."""
    if op == "max":
        return reduce(tp, x.amax(dim, keepdim=keepdim), "max")
    out = reduce(tp, x.mean(dim, keepdim=keepdim) if op == "mean" else x.sum(dim, keepdim=keepdim))
    return out / tp.size if op == "mean" and tp is not None else out


def cosine(tp: TensorParallel | None, a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """cos(a, b) along `dim` where each rank holds its heads' part of the vectors (a query of every head)."""
    if tp is None:
        return torch.nn.functional.cosine_similarity(a, b, dim=dim)
    parts = tp.all_reduce(torch.stack([(a * b).sum(dim), (a * a).sum(dim), (b * b).sum(dim)]))
    return parts[0] / (parts[1] * parts[2]).sqrt().clamp(min=1e-8)


def check_divisible(cfg, size: int) -> None:
    """SemkvError unless `size` ranks can split the model's heads, KV heads and MLP evenly."""
    for what, n in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                    ("MLP width (intermediate_size)", cfg.intermediate_size)):
        if n % size:
            divisors = [d for d in range(1, cfg.num_kv_heads + 1)
                        if cfg.num_kv_heads % d == 0 and cfg.num_heads % d == 0 and cfg.intermediate_size % d == 0]
            raise SemkvError(f"tensor_parallel_size={size} does not divide this model's {n} {what}; allowed: "
                             f"{', '.join(map(str, divisors))}")


def local_config(cfg, tp: TensorParallel):
    """The ModelConfig of one rank's shard: its heads, KV heads and MLP width, and `tp`."""
    check_divisible(cfg, tp.size)
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // tp.size, num_kv_heads=cfg.num_kv_heads // tp.size,
                               intermediate_size=cfg.intermediate_size // tp.size, tp=tp)


def shard_slice(name: str, local) -> tuple[int, int, int] | str | None:
    """How rank `local.tp.rank` takes the full checkpoint tensor `name` (HF names): (dim, start, stop) of its part,
    "rank0" for a bias added after the reduction (whole on rank 0, zero elsewhere), or None (replicated)."""
    r = local.tp.rank
    heads = {"q_proj": local.num_heads, "k_proj": local.num_kv_heads, "v_proj": local.num_kv_heads}
    for proj, n in heads.items():
        if f".self_attn.{proj}." in name:
            size = n * local.head_dim
            return 0, r * size, (r + 1) * size
    if ".self_attn.o_proj." in name:
        size = local.num_heads * local.head_dim
        return "rank0" if name.endswith("bias") else (1, r * size, (r + 1) * size)
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        return 0, r * local.intermediate_size, (r + 1) * local.intermediate_size
    if ".mlp.down_proj." in name:
        size = local.intermediate_size
        return "rank0" if name.endswith("bias") else (1, r * size, (r + 1) * size)
    return None


def take_shard(name: str, tensor, local) -> torch.Tensor:
    """This rank's part of a checkpoint tensor; `tensor` is a torch tensor or a safetensors slice (read lazily)."""
    how = shard_slice(name, local)
    if how is None:
        return tensor[:]
    if how == "rank0":
        whole = tensor[:]
        return whole if local.tp.rank == 0 else torch.zeros_like(whole)
    dim, start, stop = how
    return tensor[start:stop] if dim == 0 else tensor[:, start:stop]
