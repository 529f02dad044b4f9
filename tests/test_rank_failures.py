"""Tensor parallelism when a rank fails (issue 52), on the CPU (gloo): a rank that raises while it loads, raises or is
killed mid-generate, or fails under a server's `Session`, ends every rank within seconds, and rank 0's caller gets a
RankError that names the rank and its cause (rank 0's own error when rank 0 failed); the LLM then says it must be
made again, and a new one can be. A script that makes a tensor-parallel LLM at module level, without
`if __name__ == "__main__":`, ends with an error that says so instead of hanging."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest

import semkv
from semkv.engine.sequence import SamplingParams
from semkv.errors import RankError
from semkv.methods.streaming_llm import StreamingLLM
from test_method_matrix import CONTEXTS

pytestmark = pytest.mark.slow
SECONDS = 15  # a failure ends every rank and reaches the caller within this (measured: see each test's print)


class FailsOnOtherRanks(os.PathLike):
    """A model path that only rank 0 can read: the other ranks fail while they load."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __fspath__(self) -> str:
        if multiprocessing.parent_process() is not None:
            raise RuntimeError("injected: this rank cannot read the model")
        return self.path


@dataclass
class FailsMidway(StreamingLLM):
    """StreamingLLM whose `end_step` raises on one rank once a request has `after` tokens."""

    rank: int = 1
    after: int = 3

    def end_step(self, seqs, logits, tokens) -> None:
        if self.tp.rank == self.rank and len(seqs[0].output_ids) >= self.after:
            raise RuntimeError(f"injected on rank {self.rank}")
        super().end_step(seqs, logits, tokens)


@pytest.fixture
def path(tiny_model_dir):
    return tiny_model_dir("llama")


def two_ranks(path):
    return semkv.LLM(path, device="cpu", prefill_chunk=48, tensor_parallel_size=2)


def ends_all(llm) -> None:
    """Every other rank has ended, the LLM says it must be made again, and it closes."""
    assert all(p.exitcode is not None for p in llm.ranks.procs)
    with pytest.raises(RankError, match="every rank has ended: make a new LLM"):
        llm.generate("hello", max_new_tokens=2, chat=False)
    llm.close()


def test_a_rank_that_fails_to_load(path):
    started = time.monotonic()
    with pytest.raises(RankError, match=r"tensor-parallel rank 1 failed: RuntimeError: injected: this rank cannot "
                                        r"read the model \(at .*\)"):
        two_ranks(FailsOnOtherRanks(path))
    print(f"load failure: raised {time.monotonic() - started:.1f} s after the LLM was asked for")
    llm = two_ranks(path)  # the process may make a new one
    try:
        assert len(llm.generate("hello", max_new_tokens=3, chat=False, ignore_eos=True)[0].token_ids) == 3
    finally:
        llm.close()


def test_a_rank_that_raises_mid_generate(path):
    llm = two_ranks(path)
    one = [semkv.get_method("streaming_llm", 40)]
    want = llm.compare(CONTEXTS[0], one, max_new_tokens=8, chat=False)[0].token_ids
    started = time.monotonic()
    with pytest.raises(RankError, match=r"tensor-parallel rank 1 failed: RuntimeError: injected on rank 1 \(at "):
        llm.generate(CONTEXTS[0], method=FailsMidway(budget=40), max_new_tokens=200, chat=False, ignore_eos=True)
    elapsed = time.monotonic() - started
    print(f"rank 1 raised mid-generate: the caller had the error after {elapsed:.1f} s")
    assert elapsed < SECONDS
    ends_all(llm)
    llm = two_ranks(path)
    try:
        assert llm.compare(CONTEXTS[0], one, max_new_tokens=8, chat=False)[0].token_ids == want
    finally:
        llm.close()


def test_a_rank_killed_mid_generate(path):
    llm = two_ranks(path)
    killed = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(llm.ranks.procs[0].pid, signal.SIGKILL)

    timer = threading.Timer(3.0, kill)
    timer.start()
    try:
        with pytest.raises(RankError, match="tensor-parallel rank 1 was killed by SIGKILL"):
            llm.generate(CONTEXTS * 4, max_new_tokens=4000, chat=False, ignore_eos=True, allow_overlong=True)
    finally:
        timer.cancel()
    elapsed = time.monotonic() - killed[0]
    print(f"rank 1 killed mid-generate: the caller had the error {elapsed:.1f} s after the kill")
    assert elapsed < SECONDS
    ends_all(llm)


def test_rank_0_failing_ends_the_others(path):
    """Rank 0 raises mid-generate: its caller gets that error, and the other rank, which waits in a collective rank 0
    will not join, is ended."""
    llm = two_ranks(path)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="injected on rank 0") as error:
        llm.generate(CONTEXTS[0], method=FailsMidway(budget=40, rank=0), max_new_tokens=200, chat=False,
                     ignore_eos=True)
    assert not isinstance(error.value, RankError)
    print(f"rank 0 raised mid-generate: the caller had the error after {time.monotonic() - started:.1f} s")
    assert time.monotonic() - started < SECONDS
    with pytest.raises(RankError, match=r"tensor-parallel rank 0 failed: RuntimeError: injected on rank 0 .*; every "
                                        "rank has ended"):
        llm.generate("hello", max_new_tokens=2, chat=False)
    ends_all(llm)


def test_a_session_ends_when_a_rank_fails(path):
    """The server's path: a request whose step fails on rank 1 makes `Session.advance` raise the RankError (the server
    then stops serving), instead of the ranks drifting out of step."""
    llm = two_ranks(path)
    session = llm.new_session()
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    ids = llm.encode(CONTEXTS[1], chat=False)[0]
    session.submit(0, ids, params, semkv.get_method("full"), "full")
    session.submit(1, ids, params, FailsMidway(budget=40), "failing")
    started = time.monotonic()
    with pytest.raises(RankError, match="tensor-parallel rank 1 failed: RuntimeError: injected on rank 1"):
        while session.scheduler.busy:
            session.advance()
    print(f"rank 1 failed under a session: advance raised after {time.monotonic() - started:.1f} s")
    assert time.monotonic() - started < SECONDS
    ends_all(llm)


def test_a_script_without_the_main_guard_ends_with_a_clear_error(path, tmp_path):
    """Each rank's process imports the main script again (spawn), where it would make the LLM again: a script that
    makes it at its top level, itself or through a module it imports, ends at once with an error that says what it
    lacks (it hanged for good before); under the guard it runs."""
    make = f"import semkv\nllm = semkv.LLM({str(path)!r}, device='cpu', tensor_parallel_size=2)\n"
    (tmp_path / "helper.py").write_text(make)
    scripts = {"unguarded.py": make + "print('made', flush=True)\n", "imports.py": "import helper\nprint('made')\n",
               "guarded.py": "if __name__ == '__main__':\n    import helper\n    helper.llm.close()\n    print('made')\n"}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        started = time.monotonic()
        run = subprocess.run([sys.executable, name], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        print(f"{name}: ended after {time.monotonic() - started:.1f} s (torch imported)")
        if name == "guarded.py":
            assert run.returncode == 0 and "made" in run.stdout, run.stderr[-3000:]
            continue
        line = 2 if name == "unguarded.py" else 1
        assert run.returncode == 1 and "made" not in run.stdout
        assert run.stderr.strip().splitlines()[-1] == (
            f"semkv.errors.SemkvError: {tmp_path / name}, line {line}, makes a tensor-parallel LLM at the script's top "
            'level: a script must make a tensor-parallel LLM under `if __name__ == "__main__":` (every rank is a '
            "process that imports the script again, as multiprocessing's spawn does)"), run.stderr[-3000:]
