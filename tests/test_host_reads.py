"""The host's reads of device values in a server's steps: none once a layer, one a decode step.

On a GPU every read of a device value (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`, a boolean-mask index, `nonzero`,
...) and every copy from pageable host memory (`torch.tensor(list, device=...)`, a Python number written into a
tensor) makes the host wait for every kernel queued before it. A step may wait a few times (its tokens, a finished
prompt's first token); a wait in every layer keeps the host from running ahead of the device through a prompt chunk,
and the device then idles while the host prepares each layer (ChunkKV's prompt end waited once a layer:
benchmarks/results/2026-11-29-h200-mixed-steps.md). On the CPU nothing waits, so the reads are counted instead: a
torch function mode records them by the semkv line that made them, in the same session on a tiny Llama of 3 layers
and one of 6; a line whose reads double with the layers reads once a layer. The decode steps of the methods whose
hooks need nothing from the device read it once, for their tokens. The kernels' CPU path (`kernels/` and
the methods' `reference.py`, plain torch) is left out: on a GPU their Triton kernels run instead; so is the staging
ring's copy (`engine/staging.py`), from pinned memory without waiting on a GPU."""
from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import semkv
from semkv.engine.sequence import SamplingParams
from semkv.methods import get_method
from test_method_matrix import CASES, CONTEXTS, IDS, QUESTIONS, SMALL

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "argwhere",
         "masked_select", "unique", "unique_consecutive", "equal", "allclose"}
SEMKV = str(Path(semkv.__file__).parent)


class HostReads(TorchFunctionMode):
    """Counts the operations that wait for the device on a GPU, by the innermost semkv line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (name in READS
                or name == "tensor" and kwargs.get("device") is not None  # a copy from pageable host memory
                or name == "to" and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
                or name == "__getitem__" and _mask(args[1])  # a boolean mask: the result's size is read
                or name == "__setitem__" and isinstance(args[2], (int, float, bool))):  # a number written
            site = _site()
            if not (site.startswith(("kernels/", "engine/staging.py")) or site.split(":")[0].endswith("reference.py")):
                self.sites[f"{name} at {site}"] += 1
        return func(*args, **kwargs)


def _mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(SEMKV)]
    return f"{Path(frames[-1].filename).relative_to(SEMKV)}:{frames[-1].lineno}" if frames else "outside semkv"


def reads(llm, method, budget: int) -> collections.Counter[str]:
    """The reads of a session of the three prompts, two at a time, steps of `budget` tokens."""
    session = llm.new_session(max_num_batched_tokens=budget, max_num_seqs=2, enable_prefix_caching=True)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for i, (context, question) in enumerate(zip(CONTEXTS, QUESTIONS)):
        ids = llm.encode(f"{context}\n\n{question}", chat=False)[0]
        session.submit(i, ids, params, method, repr(method))
    with HostReads() as counted:
        while session.scheduler.busy:
            session.advance()
    assert not session.scheduler.failed
    return counted.sites


@pytest.fixture(scope="module")
def depths(tiny_model_dir):
    return [semkv.LLM(tiny_model_dir(arch), device="cpu", prefill_chunk=48) for arch in ("llama", "llama_deep")]


@pytest.mark.parametrize("name, i, params", [("full", 0, {}), *CASES], ids=["full", *IDS])
def test_no_read_of_the_device_in_every_layer(depths, name, i, params):
    counts = [reads(llm, get_method(name, SMALL, **params), 32) for llm in depths]
    grown = {site: (counts[0][site], n) for site, n in counts[1].items() if n >= 2 * max(counts[0][site], 1)}
    assert not grown, grown


# the decode steps of these read the device once, in the engine: their hooks keep to the device or the host (a method
# that picks its write slots, `begin_step`, is read where they append)
ONE_READ = [("full", {}), ("snapkv", {}), ("pyramidkv", {}), ("quest", {}), ("keydiff", {}), ("infllm", {}),
            ("chunkkv", {"neighbours": 3}), ("chess", {"anchor": "queries"}),
            ("sentencekv", {"retain": "sentences", "score": "tokens", "query": "current", "keep_factor": 1})]


@pytest.mark.parametrize("name, params", ONE_READ, ids=[name for name, _ in ONE_READ])
def test_a_decode_step_reads_the_device_once(depths, name, params):
    """After the prompts, each step of the running requests reads the device once: its tokens and statistics
    (`Engine.finish_read`; on a GPU, from the early copy of a step whose end waits behind prompt chunks). A second
    read in the method's hooks would wait for those chunks too."""
    llm, method = depths[0], get_method(name, 48, **params)
    session = llm.new_session(max_num_batched_tokens=64, max_num_seqs=3, enable_prefix_caching=False)
    for i, (context, question) in enumerate(zip(CONTEXTS, QUESTIONS)):
        ids = llm.encode(f"{context}\n\n{question}", chat=False)[0]
        session.submit(i, ids, SamplingParams(max_new_tokens=24, ignore_eos=True), method, repr(method))
    scheduler = session.scheduler
    while scheduler.waiting or scheduler.prefilling or scheduler.awaiting:  # until every request decodes
        session.advance()
    steps = 0
    with HostReads() as counted:
        while scheduler.busy:
            session.advance()
            steps += 1
    assert steps >= 8 and not scheduler.failed
    assert dict(counted.sites) == {f"tolist at {_finish_read_line()}": steps}


def _finish_read_line() -> str:
    """engine/engine.py:N, the line of `Engine.finish_read` that reads the step's values."""
    import inspect

    from semkv.engine.engine import Engine
    lines, first = inspect.getsourcelines(Engine.finish_read)
    return f"engine/engine.py:{first + next(i for i, line in enumerate(lines) if '.tolist()' in line)}"


@pytest.mark.parametrize("name", ["full", "chunkkv", "chess"])
def test_prompts_packed_in_one_forward_read_the_device_no_more_with_more_layers(depths, name, monkeypatch):
    """Follow-up questions on a cached document, submitted together, run in one forward (`Engine.prefill_together`;
    ChunkKV evicts and CHESS summarises after it): no read of the device once a layer there either."""
    counts = []
    for llm in depths:
        packs = []
        together = llm.engine.prefill_together
        monkeypatch.setattr(llm.engine, "prefill_together", lambda seqs: packs.append(len(seqs)) or together(seqs))
        method, params = get_method(name, SMALL), SamplingParams(max_new_tokens=4, ignore_eos=True)
        session = llm.new_session(max_num_batched_tokens=256, enable_prefix_caching=True)
        prompts = [llm.encode(f"{CONTEXTS[0] * 2}\n\n{q}", chat=False)[0] for q in QUESTIONS]
        session.submit(0, prompts[0], params, method, repr(method))
        while session.scheduler.prefilling or session.scheduler.waiting:
            session.advance()
        for i, ids in enumerate(prompts[1:], 1):
            session.submit(i, ids, params, method, repr(method))
        with HostReads() as counted:
            while session.scheduler.busy:
                session.advance()
        assert not session.scheduler.failed and [n for n in packs if n > 1] == [2]
        counts.append(counted.sites)
        llm.engine.pool.clear_cache()
    grown = {site: (counts[0][site], n) for site, n in counts[1].items() if n >= 2 * max(counts[0][site], 1)}
    assert not grown, grown
