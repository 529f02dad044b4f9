"""The processes of tensor parallelism on one host: the caller's process is rank 0; ranks 1..N-1 are started here
(spawned, one per GPU, or on the CPU for tests) and every rank joins one process group over TCP on 127.0.0.1: NCCL
for tensors on GPUs, gloo on the CPU, plus a gloo group for Python objects (`models.parallel.TensorParallel`).

Every rank runs the same program in step (SPMD): `LLM` sends each call it makes to the other ranks through a queue
(`Ranks.call`), which they replay; `semkv bench` runs its whole measurement on every rank. A queue, not a collective,
carries the calls, so ranks may wait for the next one as long as they like.

A rank that fails ends them all within seconds, with an error on rank 0 that names it and its cause (`RankError`): a
rank sends the text of its exception to rank 0 before it exits (`report`), and a watchdog thread on rank 0 sees a
rank's process end (a crash, a kill, a script that makes its LLM again in every rank), ends the other ranks and
aborts NCCL's collectives, so that none waits for the 30-minute timeout. Rank 0 waits for the others to join through a
store it polls, so a rank that never starts is an error too.
"""
from __future__ import annotations

import ast
import ctypes
import datetime
import gc
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from semkv.errors import RankError, SemkvError
from semkv.models.parallel import TensorParallel

TIMEOUT = datetime.timedelta(minutes=30)  # one collective may wait this long for the slowest rank (long prefills)
POLL_S = 0.1  # how often rank 0 looks at the ranks' processes and reports
GRACE_S = 3.0  # how long rank 0 waits, after a call failed there, to learn whether another rank failed first
GUARD = ('a script must make a tensor-parallel LLM under `if __name__ == "__main__":` (every rank is a process that '
         "imports the script again, as multiprocessing's spawn does)")
_reports: Any = None  # in a rank's process: the queue of what it tells rank 0 (`report`)
_rank = 0


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


def join(rank: int, size: int, store: dist.Store, device: torch.device) -> TensorParallel:
    """Join the process group of `size` ranks through `store` (blocks until all have joined)."""
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=TIMEOUT, device_id=device)
        host = dist.new_group(backend="gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=TIMEOUT)
        host = dist.group.WORLD
    return TensorParallel(rank, size, dist.group.WORLD, host)


def check_guarded() -> None:
    """SemkvError when this call comes from the top level of the main script, outside `if __name__ == "__main__":`:
    every rank's process would import the script and make the LLM again (found from the calling frame and the
    script's syntax tree, before any process starts)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame, top = sys._getframe(1), None
    while frame is not None:  # the main script's own top-level frame, if it is a caller
        if frame.f_globals is getattr(main, "__dict__", None) and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None or path is None:
        return
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and node.lineno <= top.f_lineno <= node.end_lineno and _is_main_test(node.test):
            return
    raise SemkvError(f"{path}, line {top.f_lineno}, makes a tensor-parallel LLM at the script's top level: {GUARD}")


def _is_main_test(test: ast.expr) -> bool:
    names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
    values = {n.value for n in ast.walk(test) if isinstance(n, ast.Constant)}
    return "__name__" in names and "__main__" in values


def report(kind: str, text: str = "") -> None:
    """Tell rank 0, from another rank: "ready" once loaded, "failed" with the cause."""
    if _reports is not None:
        _reports.put((_rank, kind, text))


def describe(error: BaseException) -> str:
    """An exception in one line: its type, its message and where it was raised."""
    frames = traceback.extract_tb(error.__traceback__)[-1:]
    at = f" (at {frames[0].filename}:{frames[0].lineno} in {frames[0].name})" if frames else ""
    return f"{type(error).__name__}: {error}{at}"


def freeze_heap() -> int:
    """Collect, then freeze every object alive now (the model, its modules, the libraries) so that the cyclic garbage
    collector never walks them again, as vLLM's processes do after their start: a full collection of a process holding
    the embedded model walks about 370,000 objects (184 ms on two CPU cores), a pause that lands on whichever step
    allocates past the collector's threshold; after the freeze it takes well under a millisecond. For a serving
    process, once its start and warm-up are done. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def end_with_parent() -> None:
    """Have this process end (SIGTERM) when the process that started it ends, even when that one is killed and has no
    chance to say so, and even while this one waits inside a collective (Linux; elsewhere the callers poll)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _worker(target: Callable, rank: int, size: int, port: int, device: torch.device,
            calls: multiprocessing.Queue, reports: multiprocessing.Queue, args: tuple) -> None:
    global _reports, _rank
    _reports, _rank = reports, rank
    end_with_parent()  # end with rank 0
    report("started")
    try:
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=TIMEOUT)
        store.set(f"semkv/joined/{rank}", "1")
        target(join(rank, size, store, device), rank_device(device, rank), calls, *args)
    except BaseException as error:  # noqa: BLE001 - rank 0 raises it to its caller
        traceback.print_exc()
        report("failed", describe(error))
        reports.close()
        reports.join_thread()  # the report is on its way; the process ends now, whatever its collectives wait for
        os._exit(1)
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
    `calls` is a queue of what rank 0 sends (`call`; None at the end). This process joins as rank 0 (`tp`). A watchdog
    thread ends every rank once one fails (`failure` says which and why); `judge` tells a caller what to raise."""

    def __init__(self, size: int, device: torch.device, target: Callable, args: tuple = ()):
        if dist.is_initialized():
            raise SemkvError("this process already belongs to a tensor-parallel group: close the other LLM first "
                             "(LLM.close()); one tensor-parallel LLM per process")
        if getattr(multiprocessing.current_process(), "_inheriting", False):  # a rank importing the main module
            raise SemkvError(f"a rank's process, while it starts, is asked to make a tensor-parallel LLM: {GUARD}")
        check_guarded()
        ctx = multiprocessing.get_context("spawn")
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=TIMEOUT, wait_for_workers=False)
        self.size, self.tp, self.device = size, None, rank_device(device, 0)
        self.failure: str | None = None
        self.started: set[int] = set()
        self.ready: set[int] = set()
        self.closing = False
        self.lock = threading.Lock()
        self.calls = [ctx.Queue() for _ in range(size - 1)]
        self.reports = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, name=f"semkv-rank{r}", daemon=True, args=(
            target, r, size, store.port, device, self.calls[r - 1], self.reports, args)) for r in range(1, size)]
        for p in self.procs:
            p.start()
        threading.Thread(target=self._watch, name="semkv-rank-watchdog", daemon=True).start()
        try:
            self._wait(lambda: all(store.check([f"semkv/joined/{r}"]) for r in range(1, size)))
            self.check()
            self.tp = join(0, size, store, device)
        except BaseException:
            self.close()
            raise

    def call(self, what: Any) -> None:
        """Send a call to every other rank. It is pickled here, so that what cannot be sent fails in the caller (a
        queue would fail in its feeder thread, and the ranks would wait for ever)."""
        self.check()
        try:
            data = pickle.dumps(what)
        except Exception as exc:  # noqa: BLE001 - pickle raises many kinds
            raise SemkvError(f"with tensor parallelism every call goes to the other ranks' processes, and this one "
                             f"cannot be pickled ({type(exc).__name__}: {exc}); pass importable objects") from None
        for q in self.calls:
            q.put(data)

    def check(self) -> None:
        """RankError if a rank has failed, or its process has ended (a moment is left for its report)."""
        if self.failure is None and any(p.exitcode is not None for p in self.procs):
            self._wait(lambda: False, GRACE_S)  # the watchdog names it
        if self.failure is not None:
            raise RankError(f"{self.failure}; every rank has ended: make a new LLM")

    def wait_ready(self) -> None:
        """Return once every other rank has reported "ready" (`report`); RankError if one fails first."""
        self._wait(lambda: len(self.ready) == self.size - 1)
        self.check()

    def judge(self, error: BaseException) -> BaseException | None:
        """What a caller on rank 0 raises after a call that every rank replays raised `error` there: None when the
        ranks are still in step (bad input, or a request that does not fit: every rank checks and decides alike),
        else a RankError naming the rank that failed, or `error` itself when it is rank 0's own failure (the other
        ranks, which may wait in a collective rank 0 will never join, are then ended)."""
        if self.failure is None and isinstance(error, (SemkvError, MemoryError)):
            return None
        self._wait(lambda: False, GRACE_S)
        if self.failure is None:
            self._fail(f"tensor-parallel rank 0 failed: {describe(error)}")
            return error
        return error if self.failure.startswith("tensor-parallel rank 0 ") else RankError(self.failure)

    def close(self) -> None:
        """End the other ranks and leave the group."""
        self.closing = True
        for q, p in zip(self.calls, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=1 if self.failure else 60)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized() and self.tp is not None:
            if self.failure is None:
                dist.destroy_process_group()
            else:  # the others are gone: leave without waiting for them
                self.tp.abort()

    def _wait(self, done: Callable[[], bool], timeout: float = float("inf")) -> None:
        """Poll until `done` holds, a rank has failed or `timeout` seconds have passed."""
        deadline = time.monotonic() + timeout
        while not done() and self.failure is None and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _watch(self) -> None:
        """The watchdog: read the ranks' reports; once a rank fails, or its process ends without a report, end them
        all."""
        ended: dict[int, float] = {}  # rank -> when its process was first seen ended
        while not self.closing and self.failure is None:
            try:
                rank, kind, text = self.reports.get(timeout=POLL_S)
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(self.procs, 1):  # a report sent just before the end may still be on its way
                    if p.exitcode is not None and now - ended.setdefault(r, now) > GRACE_S / 3 and not self.closing:
                        self._fail(self._ended(r, p))
                        break
                continue
            if kind == "failed":
                self._fail(f"tensor-parallel rank {rank} failed: {text}")
            else:
                (self.started if kind == "started" else self.ready).add(rank)

    def _ended(self, rank: int, process: multiprocessing.Process) -> str:
        code = process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        text = f"tensor-parallel rank {rank} {how}"
        if rank not in self.started:  # it never ran semkv's code: it failed while importing the main module
            text += " before it started"
            if getattr(sys.modules["__main__"], "__file__", None):
                text += f" (its error is printed above); if this is a script: {GUARD}"
        return text

    def _fail(self, text: str) -> None:
        """A rank failed: end the others, abort NCCL's collectives in flight here (gloo's fail by themselves once a
        peer's connection closes), then say why (`failure`)."""
        with self.lock:  # the watchdog, or the caller's thread (`judge`)
            if self.failure is not None:
                return
            for p in self.procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            if self.tp is not None and dist.is_initialized() and dist.get_backend(self.tp.group) == "nccl":
                self.tp.abort()
            self.failure = text


def run_ranks(size: int, device: torch.device, fn: Callable, args: tuple = ()) -> Any:
    """Run `fn(tp, device, *args)` on `size` ranks at once (the whole program in step, e.g. a benchmark); return
    rank 0's result. size 1: `fn(None, device, *args)` in this process."""
    if size == 1:
        return fn(None, device, *args)
    ranks = Ranks(size, device, _run_once, (fn, args))
    try:
        return fn(ranks.tp, ranks.device, *args)
    except BaseException as error:
        raise_judged(ranks, error)
        raise
    finally:
        ranks.close()


def raise_judged(ranks: Ranks, error: BaseException) -> None:
    """Inside an `except` of `error` raised by a call every rank replays: raise what `Ranks.judge` says, chained to
    it, when that is not `error` itself (the caller then re-raises `error`)."""
    verdict = ranks.judge(error)
    if verdict is not None and verdict is not error:
        raise verdict from error


def _run_once(tp: TensorParallel, device: torch.device, calls, fn: Callable, args: tuple) -> None:
    fn(tp, device, *args)
