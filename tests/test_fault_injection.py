"""The fault-injection suite (issue 52): for every method (each one's defaults, the configurations that offload to host
memory, TokenSelect's int8 key sketch and page summaries and DynSplit-KV's page summaries, state kept by page), failures
injected into the allocations of method state and KV pages, the host-offload copies, each hook the method implements and
the sampling step (`faults.Injector`: the N-th call of one point raises), through `LLM.generate` (one request),
continuous batching (six requests through `generate`, two at a time in a small pool, sampled, with log-probabilities),
`LLM.compare` and the server's `Session` (submit, advance, cancel), with whole prompts and as `semkv serve` runs it
(chunked prefill between decode steps, prefix caching).

After each injected failure:
- the caller sees the injected error (or a MemoryError naming it), not a second one raised while cleaning up; the
  session contains it in the failed request(s) and goes on;
- `engine.memory()` holds nothing: no live request, no page in use, no byte of method state;
- the bytes of the tensors alive in the process equal those before the failure: a walk of the garbage collector's
  objects sees a tensor wherever it is kept (a method's buffers, a cache, a cycle), unlike the engine's accounting,
  which sees what its live requests reach. The objects alive before the failures are frozen (`gc.freeze`), so each
  collection and walk sees only what was made since, in milliseconds;
- the next request gives the tokens it gave before the failure.

Each point fails at the middle one of the calls a clean run of a path makes of it, in every path that reaches it (an
allocation also at its second call). The suite counts the failures it injected and the points.
"""
from __future__ import annotations

import contextlib
import gc
import math

import pytest
import torch

import semkv
from faults import POINTS, Injected, Injector, hook_points
from semkv.engine.sequence import SamplingParams
from semkv.methods import METHODS, get_method
from test_method_matrix import CONTEXTS, HARD, NEED, QUESTIONS, SMALL, live_tensor_bytes

NEW = 6
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=5, logprobs=2)  # continuous batching samples: the sampler runs
CONFIGS = {name: (name, {}) for name in METHODS if name != "full"} | {  # each method's defaults, and offloading
    f"{name}-offload": (name, params) for name in ("sentencekv", "dynsplit") for params in HARD[name]
    if params.get("offload")} | {"tokenselect-int8": ("tokenselect", dict(score_keys="int8", prefill="full")),
                                    "tokenselect-pages": ("tokenselect", dict(score_keys="pages", prefill="full")),
                                    "dynsplit-pages": ("dynsplit", dict(score="tokens", score_keys="pages"))}
INJECTED: list[tuple[str, str, str]] = []  # (config, path, point) of every failure injected and cleaned up


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """A fixed pool that holds two of the requests at once (the others of a batch wait). One thread: the tiny
    model's operations are too small to share, and threads that wait for a busy core cost more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield semkv.LLM(tiny_model_dir("llama"), device="cpu", prefill_chunk=48, num_pages=2 * NEED + 2)
    torch.set_num_threads(threads)


# -- the paths a request takes ------------------------------------------------------------------------------------------
def generate(llm, method, want=None) -> list[list[int]]:
    out = llm.generate(CONTEXTS[:1], method=method, questions=QUESTIONS[:1], max_new_tokens=NEW, chat=False,
                       ignore_eos=True)
    return [o.token_ids for o in out]


def batching(llm, method, want=None) -> list[list[int]]:
    out = llm.generate(CONTEXTS * 2, method=method, questions=QUESTIONS * 2, max_new_tokens=NEW, chat=False,
                       ignore_eos=True, **SAMPLED)
    return [o.token_ids for o in out]


def compare(llm, method, want=None) -> list[list[int]]:
    out = llm.compare(CONTEXTS[1], [method, get_method("full")], question=QUESTIONS[1], max_new_tokens=NEW,
                      chat=False)
    return [o.token_ids for o in out]


def session(llm, method, want: list[list[int]] | None = None, late: int = 1, pipeline: bool = False,
            **options) -> list[list[int]]:
    """The server's path: requests of the method and one of Full KV (cancelled after its first token) arrive, and
    `late` more of the method (the first one's prompt again) once the first has its first token, so they are admitted
    beside a running one; the session advances until none is left. An injected failure must end its request(s)
    alone: it raises from `submit`, or the request ends with it in `failed`; `advance` never raises, and the other
    requests end as they would have (with the tokens `want` of a clean run). options: `LLM.new_session`'s (whole
    prompts, no prefix cache); pipeline: the scheduler's (on CUDA by default, off on the CPU)."""
    s = llm.new_session(**{"enable_prefix_caching": False, **options})
    s.scheduler.pipeline = pipeline
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=1)
    seqs, errors = {}, []
    kept = [0, 1, *range(3, 3 + late)]  # the requests not cancelled

    def submit(i: int, m, key: str) -> None:
        try:
            seqs[i] = s.submit(i, llm.encode(CONTEXTS[i % 3], chat=False)[0], params, m, key)
        except Injected as error:
            errors.append(error)

    try:
        for i, (m, key) in enumerate([(method, "m"), (method, "m"), (get_method("full"), "full")]):
            submit(i, m, key)
        while s.scheduler.busy:
            try:
                s.advance()
            except BaseException as error:  # the server's engine thread would end here
                raise AssertionError(f"Session.advance raised {type(error).__name__}: {error}") from error
            if 2 in seqs and seqs[2].output_ids and not seqs[2].finished:
                s.cancel(2)
            if 3 not in seqs and (0 not in seqs or seqs[0].output_ids):
                for i in kept[2:]:
                    submit(i, method, "m")
            errors += [error for _, error in s.scheduler.failed]
            s.scheduler.failed.clear()
    finally:
        llm.session = None
    for i, q in seqs.items():  # the others end as they would have
        assert q.finished and (len(q.output_ids) == NEW) == (q.finish_reason == "length"), (i, q.finish_reason)
        if want is not None and i != 2 and q.finish_reason == "length":
            assert q.output_ids == want[kept.index(i)], f"request {i} gave other tokens beside the failure"
    for error in errors[1:]:  # a request that failed after the injected failure, for what it left behind
        assert named(error), f"a later request failed with {type(error).__name__}: {error}"
    if errors:
        raise errors[0]
    return [seqs[i].output_ids for i in kept]


def serving(llm, method, want: list[list[int]] | None = None) -> list[list[int]]:
    """The session as `semkv serve` runs it: prompts prefilled 16 tokens a step between decode steps, and the prefix
    cache on (the fourth request starts from the first one's cached pages where the method shares them), cold at the
    start, so that every run makes the same calls."""
    llm.reset_prefix_cache()
    return session(llm, method, want, max_num_batched_tokens=16, enable_prefix_caching=True)


def packed(llm, method, want: list[list[int]] | None = None) -> list[list[int]]:
    """The serving session with two late requests, submitted together: where the method allows, their prompts' last
    chunks after the cached pages run in one forward (`Engine.prefill_together`)."""
    llm.reset_prefix_cache()
    return session(llm, method, want, late=2, max_num_batched_tokens=256, enable_prefix_caching=True)


def pipelined(llm, method, want: list[list[int]] | None = None) -> list[list[int]]:
    """The serving session with pipelined decode steps (`Scheduler.pipeline`, as on CUDA): once the requests of the
    method decode alone, each step is launched before the last one is ended."""
    llm.reset_prefix_cache()
    return session(llm, method, want, pipeline=True, max_num_batched_tokens=16, enable_prefix_caching=True)


PATHS = {"batching": batching, "generate": generate, "compare": compare, "session": session, "serving": serving,
         "packed": packed, "pipelined": pipelined}


def plan(calls: dict[str, dict]) -> list[tuple[str, object, int]]:
    """(path, point, call) of each failure to inject: every point in every path that reaches it, at the middle one
    of its calls; an allocation also at its second call (inside a growth of several tensors, with later requests
    to be admitted)."""
    chosen = []
    for point in sorted({pt for counts in calls.values() for pt in counts}, key=lambda p: p.name):
        for path, counts in calls.items():
            n = counts[point]
            picks = {math.ceil(n / 2)} | ({2} if point.kind == "allocation" and n > 2 else set()) if n else set()
            chosen += [(path, point, call) for call in sorted(picks)]
    return chosen


def named(error: BaseException) -> bool:
    """The injected error, or a MemoryError naming it."""
    return isinstance(error, Injected) or isinstance(error, MemoryError) and "injected" in str(error)


def failing_run(llm, path: str, method, points, fail, want) -> tuple[BaseException | None, bool]:
    """Run a path with one point failing: the error the caller got (None if none), and whether the failure was
    injected (the point reached its failing call)."""
    with Injector(points, fail) as injector:
        try:
            PATHS[path](llm, method, want)
        except BaseException as error:  # noqa: BLE001 - judged by the caller
            return error, True
    return None, injector.calls[fail[0]] >= fail[1]


@contextlib.contextmanager
def frozen():
    """The objects alive now left out of the garbage collector's collections and walks until the end (`gc.freeze`):
    a collection and a walk of the tensors then see only what was made since, in milliseconds."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("config", CONFIGS)
def test_every_injected_failure_cleans_up(llm, config):
    name, params = CONFIGS[config]
    method = get_method(name, SMALL, **params)
    points = [p for p in POINTS if hasattr(p.owner, p.attribute)] + hook_points(method)
    calls, want = {}, {}
    for path, run in PATHS.items():  # clean runs: what each point is called, the tokens, caches warmed up
        with Injector(points) as counting:
            want[path] = run(llm, method)
        calls[path] = counting.calls
    with frozen():
        baseline = live_tensor_bytes()
        for path, point, call in plan(calls):
            where = f"{config} / {path} / {point.name} call {call}"
            error, injected = failing_run(llm, path, method, points, (point, call), want[path])
            if not injected:  # how often a path reaches a point can depend on the pool's state kept by page, which
                # the runs before grew (DynSplit-KV's device_tokens, asked only when pages may run short): counted
                # again in this state, injected at its middle call, or nothing to inject
                with Injector(points) as counting:
                    PATHS[path](llm, method)
                if not counting.calls[point]:
                    continue
                where += f" (called {counting.calls[point]} times now)"
                error, injected = failing_run(llm, path, method, points, (point, math.ceil(counting.calls[point] / 2)),
                                              want[path])
            assert error is not None, f"{where}: no error reached the caller"
            assert named(error), f"{where}: the caller got {type(error).__name__}: {error}"
            del error
            assert llm.engine.memory().held == (0, 0, 0, 0), where
            gc.collect()
            assert live_tensor_bytes() == baseline, where
            assert generate(llm, method) == want["generate"], where
            INJECTED.append((config, path, point.name))


@pytest.mark.parametrize("config", ["chunkkv", "chess"])
def test_a_failure_in_a_servers_warm_up_reaches_its_caller_and_leaves_nothing(llm, config):
    """`Session.warm_up` (a server's start, with its default method): every point its clean run reaches fails at its
    middle call; the warm-up raises that failure (the server says it and does not start) and nothing is held or
    cached after it."""
    name, params = CONFIGS[config]
    method = get_method(name, SMALL, **params)
    points = [p for p in POINTS if hasattr(p.owner, p.attribute)] + hook_points(method)

    def warm_up() -> None:
        llm.reset_prefix_cache()
        try:
            llm.new_session(max_num_batched_tokens=16, enable_prefix_caching=True).warm_up(method, "m")
        finally:
            llm.session = None

    with Injector(points) as counting:
        warm_up()
    assert counting.calls
    for point, n in counting.calls.items():
        where = f"{config} / warm-up / {point.name} call {math.ceil(n / 2)}"
        with Injector(points, (point, math.ceil(n / 2))), pytest.raises(BaseException) as caught:
            warm_up()
        assert named(caught.value), f"{where}: the caller got {type(caught.value).__name__}: {caught.value}"
        memory = llm.engine.memory()
        assert memory.held == (0, 0, 0, 0) and memory.cached_pages == 0, where
        INJECTED.append((config, "warm-up", point.name))


def test_the_count_of_injected_failures(capsys):
    """Runs after the others (pytest keeps a file's order): says how many failures were injected, at how many points
    (a point: one method configuration's allocation, copy, hook or sampling step) and that each path had its
    share."""
    if not INJECTED:
        pytest.skip("no failure injected in this session (the suite's tests were not selected)")
    points = {(config, point) for config, _, point in INJECTED}
    paths = {path: sum(p == path for _, p, _ in INJECTED) for path in PATHS}
    with capsys.disabled():
        print(f"\nfault injection: {len(INJECTED)} failures injected and cleaned up, at {len(points)} points of "
              f"{len({c for c, _ in points})} method configurations; by path: {paths}")
    assert all(paths.values())
