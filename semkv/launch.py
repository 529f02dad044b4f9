"""The processes of tensor parallelism on one host: the caller's process is rank 0; ranks 1..N-1 are started here
(spawned, one per GPU, or on the CPU for tests) and every rank joins one process group over TCP on 127.0.0.1: NCCL
for tensors on GPUs, gloo on the CPU, plus a gloo group for Python objects (`models.parallel.TensorParallel`).

Every rank runs the same program in step (SPMD): `LLM` sends each call it makes to the other ranks through a queue
(`Ranks.call`), which they replay; `semkv bench` runs its whole measurement on every rank. A queue, not a collective,
carries the calls, so ranks may wait for the next one as long as they like.
"""
from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import pickle
import queue
import signal
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from semkv.errors import SemkvError
from semkv.models.parallel import TensorParallel

TIMEOUT = datetime.timedelta(minutes=30)  # one collective may wait this long for the slowest rank (long prefills)


def check_size(size: Any, device: torch.device) -> None:
    """SemkvError unless `size` ranks can run on `device` (one GPU each on CUDA)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise SemkvError(f"tensor_parallel_size={size!r} must be an int >= 1")
    if size == 1:
        return
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise SemkvError(f"device {str(device)!r} with tensor_parallel_size={size}: the ranks use cuda:0.."
                             f"cuda:{size - 1}; give device 'cuda' (select GPUs with CUDA_VISIBLE_DEVICES)")
        count = torch.cuda.device_count()
        if size > count:
            raise SemkvError(f"tensor_parallel_size={size} asks for {size} GPUs; {count} visible")
    elif not dist.is_gloo_available():
        raise SemkvError("tensor parallelism on the CPU needs torch.distributed with gloo")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """GPU `rank` on CUDA; the CPU stays the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join(rank: int, size: int, address: str, device: torch.device) -> TensorParallel:
    """Join the process group of `size` ranks (blocks until all have joined)."""
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=address, rank=rank, world_size=size, timeout=TIMEOUT,
                                device_id=device)
        host = dist.new_group(backend="gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size, timeout=TIMEOUT)
        host = dist.group.WORLD
    return TensorParallel(rank, size, dist.group.WORLD, host)


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def end_with_parent() -> None:
    """Have this process end (SIGTERM) when the process that started it ends, even when that one is killed and has no
    chance to say so, and even while this one waits inside a collective (Linux; elsewhere the callers poll)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker(target: Callable, rank: int, size: int, address: str, device: torch.device,
            calls: multiprocessing.Queue, args: tuple) -> None:
    end_with_parent()  # end with rank 0
    tp = join(rank, size, address, device)
    try:
        target(tp, rank_device(device, rank), calls, *args)
    finally:
        dist.destroy_process_group()


def receive(calls: multiprocessing.Queue) -> Any:
    """The next call from rank 0 (`Ranks.call`), or None when rank 0 is done or its process is gone."""
    parent = multiprocessing.parent_process()
    while True:
        try:
            data = calls.get(timeout=1.0)
            return None if data is None else pickle.loads(data)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None


class Ranks:
    """Ranks 1..N-1 of this process's tensor-parallel group, each running `target(tp, device, calls, *args)`, where
    `calls` is a queue of what rank 0 sends (`call`; None at the end). This process joins as rank 0 (`tp`)."""

    def __init__(self, size: int, device: torch.device, target: Callable, args: tuple = ()):
        if dist.is_initialized():
            raise SemkvError("this process already belongs to a tensor-parallel group: close the other LLM first "
                             "(LLM.close()); one tensor-parallel LLM per process")
        ctx = multiprocessing.get_context("spawn")
        address = _free_address()
        self.calls = [ctx.Queue() for _ in range(size - 1)]
        self.procs = [ctx.Process(target=_worker, args=(target, r, size, address, device, self.calls[r - 1], args),
                                  name=f"semkv-rank{r}", daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()
        try:
            self.tp = join(0, size, address, device)
        except BaseException:
            self._stop()
            raise
        self.device = rank_device(device, 0)

    def call(self, what: Any) -> None:
        """Send a call to every other rank. It is pickled here, so that what cannot be sent fails in the caller (a
        queue would fail in its feeder thread, and the ranks would wait for ever)."""
        dead = self.dead()
        if dead:
            raise SemkvError(f"tensor-parallel rank process(es) {', '.join(dead)} ended; make a new LLM")
        try:
            data = pickle.dumps(what)
        except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
            raise SemkvError(f"with tensor parallelism every call goes to the other ranks' processes, and this one "
                             f"cannot be pickled ({type(exc).__name__}: {exc}); pass importable objects") from None
        for q in self.calls:
            q.put(data)

    def dead(self) -> list[str]:
        """The names of the rank processes that have ended."""
        return [p.name for p in self.procs if not p.is_alive()]

    def close(self) -> None:
        """End the other ranks and leave the group."""
        self._stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop(self) -> None:
        for q, p in zip(self.calls, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
        self.procs = []


def run_ranks(size: int, device: torch.device, fn: Callable, args: tuple = ()) -> Any:
    """Run `fn(tp, device, *args)` on `size` ranks at once (the whole program in step, e.g. a benchmark); return
    rank 0's result. size 1: `fn(None, device, *args)` in this process."""
    if size == 1:
        return fn(None, device, *args)
    ranks = Ranks(size, device, _run_once, (fn, args))
    try:
        return fn(ranks.tp, ranks.device, *args)
    finally:
        ranks.close()


def _run_once(tp: TensorParallel, device: torch.device, calls, fn: Callable, args: tuple) -> None:
    fn(tp, device, *args)
