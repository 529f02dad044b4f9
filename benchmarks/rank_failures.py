"""How fast a tensor-parallel LLM ends when a rank fails, on GPUs (NCCL): the CPU tests (tests/test_rank_failures.py)
cover gloo, whose collectives fail by themselves once a peer's connection closes; with NCCL a collective that waits
for a rank that is gone returns only because rank 0's watchdog aborts the communicators (`TensorParallel.abort`).

For each case the script prints the seconds from the failure (the request, or the kill) to the error rank 0's caller
gets, and the error's first line; then it checks that a new LLM loads in the same process and answers.

    python3 benchmarks/rank_failures.py --model <HF folder or .gguf> [--size 2]
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from dataclasses import dataclass

import semkv
from semkv.methods.streaming_llm import StreamingLLM

PROMPT = "Paged attention stores keys and values in fixed-size pages, and a page table maps positions to pages. " * 40


@dataclass
class FailsMidway(StreamingLLM):
    """StreamingLLM whose `end_step` raises on one rank once a request has 3 tokens."""

    rank: int = 1

    def end_step(self, seqs, logits, tokens) -> None:
        if self.tp.rank == self.rank and len(seqs[0].output_ids) >= 3:
            raise RuntimeError(f"injected on rank {self.rank}")
        super().end_step(seqs, logits, tokens)


def timed(name: str, llm: semkv.LLM, run, kill_after: float | None = None) -> None:
    start = [time.monotonic()]
    if kill_after is not None:
        def kill() -> None:
            start[0] = time.monotonic()
            os.kill(llm.ranks.procs[0].pid, signal.SIGKILL)

        threading.Timer(kill_after, kill).start()
    try:
        run()
        print(f"{name}: no error")
    except BaseException as error:  # noqa: BLE001 - measured
        first = str(error).splitlines()[0][:200]
        print(f"{name}: {time.monotonic() - start[0]:.2f} s to {type(error).__name__}: {first}")
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--size", type=int, default=2)
    args = parser.parse_args()

    def make() -> semkv.LLM:
        return semkv.LLM(args.model, device="cuda", tensor_parallel_size=args.size)

    long = dict(max_new_tokens=4000, chat=False, ignore_eos=True)
    for rank in (1, 0):
        llm = make()
        timed(f"rank {rank} raises mid-generate", llm,
              lambda: llm.generate(PROMPT, method=FailsMidway(budget=256, rank=rank), **long))
    llm = make()
    timed("rank 1 killed mid-generate", llm, lambda: llm.generate([PROMPT] * 8, **long), kill_after=5.0)
    llm = make()
    print("a new LLM after the failures:", llm.generate(PROMPT, max_new_tokens=8, chat=False)[0].token_ids)
    llm.close()


if __name__ == "__main__":
    main()
