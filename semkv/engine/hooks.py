"""The method interface the engine defines: what a KV method implements and what it is handed.

A method is a dataclass of its parameters; the engine binds a private copy of it (`KVMethod.bound`) and calls its
hooks at fixed points, never looking inside. Core hooks (`KVMethod`), which a simple method implements:

Prefill (one sequence, chunk by chunk, layer by layer):
    prefill_context(layer, seq, q, start)  -> slots of earlier tokens this chunk attends to (None: all)
                                              [sparse prefill]
    observe_prefill(layer, seq, q, start, lse) -> watch a chunk after its attention (e.g. accumulate attention
                                              statistics from its log-sum-exps: `prefill_lse`)
    evict_prefill(layer, seq, q_window)    -> slots to keep [kv_heads or 1, n_keep] (None: keep all)   [eviction]
        called once per layer right after the last prompt chunk's attention; `q_window` are the queries of the last
        `window_size()` prompt tokens. The engine compacts the kept slots and frees the pages behind them.
    evict_prefill_layers(seq, q_windows)   -> every layer's slots to keep at once, after a packed chunk's forward
        (default: `evict_prefill` layer by layer); a method that scores every layer in one pass overrides it.
    finish_prefill(seq)                    -> build summaries / offload after all layers are done.
Decode (a batch, one token per sequence):
    begin_step(batch)                      -> slots the new tokens overwrite [B, layers, kv_heads] (None: append)
    select(layer, batch, q)                -> `Selection` of slots each KV head attends to (None: all stored)
    end_step(seqs, logits, tokens)         -> update per-sequence state once the tokens are known (sentence ends...).

Fast-path and admission hooks (`BatchedHooks`), for methods that keep batched state on the device or decide a step
once for every layer:
    admit(seq) / admission_bytes(seq)  -> device memory beside the KV pool, taken at admission
    admission_host_bytes(seq)          -> host memory for offloaded K/V, taken at admission
    device_tokens(prompt, new, page)   -> slots a layer holds on the device at most (None: Full KV)
    release(seq) -> the request ended (finished, stopped, failed or cancelled): forget it
    reset()      -> the run ended: drop every buffer kept for its requests
    step_plan(batch) -> a typed `StepPlan`; plan_buffers(...) its static copy under CUDA graphs;
    plan_selection(batch, plan) -> one `Selection` for every layer of the step (CHESS), inside the graph
    observe_logits(seqs, logits) -> device work on a step's logits while the forward runs (entropy)
    graph_epoch -> bumped when device buffers a captured step points at move.
    idle_graphs -> True when its captured steps read no buffer of its own: a server keeps them between requests.
    steady_slots -> False when end_step may move cached slots (no step is prepared ahead).

The budget is the number of cached positions one KV head of one layer attends to (or keeps) in a decode step, sinks
and recent window included: an int is tokens, a float in (0, 1] a fraction of the current context.
"""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from semkv.errors import INT_MAX, SemkvError

if TYPE_CHECKING:
    from semkv.engine.kv_cache import KVPool
    from semkv.engine.sequence import Sequence
    from semkv.models.config import ModelConfig


@dataclass
class Selection:
    """Logical slots each KV head attends to in one layer: slots [B, S, n] ascending and padded, lengths [B, S];
    S is 1 (one set shared by the heads of the layer) or kv_heads. One object may serve several layers."""

    slots: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "Selection":
        """mask [B, S, n] of selected slots -> Selection (ascending slots)."""
        lengths = mask.sum(-1)
        n = max(int(lengths.max()), 1)
        # stable sort puts selected slots first, in ascending order
        order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[..., :n]
        return cls(slots=order, lengths=lengths)


@dataclass
class StepPlan:
    """Per-sequence decisions of one decode step, made on the host before the forward (`BatchedHooks.step_plan`). A
    method subclasses it as a dataclass of int64 tensors, batch first: [B] (one value a row) or [B, w] (a padded
    list a row). Under CUDA graphs the plan is copied into static buffers of the same type (`static`); a field's
    padding value is its `pad` metadata (default 0): `pages: torch.Tensor = field(metadata={"pad": -1})`.

    A plan of [B] fields only may be `packed`: every field a row of one [fields, B] tensor, sent from the host in one
    copy (`send`) and copied into packed static buffers in two (not two a field: SentenceKV's eight fields were 16
    small copies a step)."""

    # not dataclass fields (no annotations): set on packed plans
    packed = None  # [fields, B] int64 whose rows are the fields, or None
    padding = None  # packed static buffers: [fields, 1], each field's padding value

    @classmethod
    def static(cls, size: int, device: torch.device, widths: dict[str, int] | None = None) -> "StepPlan":
        """Buffers for `size` rows, filled with padding; `widths` gives the columns of each [B, w] field (none:
        packed)."""
        if not widths:
            padding = torch.tensor([[f.metadata.get("pad", 0)] for f in fields(cls)], dtype=torch.long, device=device)
            plan = cls._packed(padding.repeat(1, size))
            plan.padding = padding
            return plan
        return cls(**{f.name: torch.full((size, widths[f.name]) if f.name in widths else (size,),
                                         f.metadata.get("pad", 0), dtype=torch.long, device=device)
                      for f in fields(cls)})

    @classmethod
    def send(cls, staging: Any, rows: list[list[int]]) -> "StepPlan":
        """A packed plan from each row's values, in field order (B lists of host ints): one copy to the device
        through `staging` (`engine.staging.HostStaging`) that does not wait for it."""
        return cls._packed(staging.send(np.asarray(rows, dtype=np.int64).reshape(len(rows), -1).T))

    @classmethod
    def _packed(cls, packed: torch.Tensor) -> "StepPlan":
        plan = cls(*packed.unbind(0))
        plan.packed = packed
        return plan

    def copy_to(self, static: "StepPlan", n: int) -> None:
        """Into static buffers: this plan's n rows, padding to the right of each list and in the rows below."""
        if self.packed is not None and static.packed is not None:
            static.packed[:, :n] = self.packed
            static.packed[:, n:] = static.padding
            return
        for f in fields(self):
            given, buffer, pad = getattr(self, f.name), getattr(static, f.name), f.metadata.get("pad", 0)
            if given.dim() == 1:
                buffer[:n] = given
            else:
                buffer[:n, : given.shape[1]] = given
                buffer[:n, given.shape[1]:] = pad
            buffer[n:] = pad


@dataclass(frozen=True)
class DecodeBatch:
    """What `select` sees of a decode step. num_slots counts the current token, which is stored before selection.

    `graphed`: the step is a CUDA-graph capture (or its eager stand-in on the CPU): the tensors are static buffers
    padded to the graph's batch size (padding rows point at a scratch page), `seqs` is empty and `max_slots` is the
    capacity; methods marked `graph_safe` compute from these tensors only."""

    seqs: list["Sequence"]
    positions: torch.Tensor  # [B] position of the current token
    num_slots: torch.Tensor  # [B, layers] stored slots per layer, current token included
    model: "ModelConfig"
    tables: torch.Tensor | None = None  # [B, layers, max_pages] physical page ids
    max_slots: int = 0  # upper bound of num_slots (fixes shapes without reading device values)
    step_plan: StepPlan | None = None  # from `BatchedHooks.step_plan`
    pool: "KVPool | None" = None  # the paged K/V storage the tables point into
    graphed: bool = False
    tokens: torch.Tensor | None = None  # [B] the current token ids (the forward's input; on the device)

    @property
    def size(self) -> int:
        return self.positions.shape[0]


def resolve_budget(budget: int | float | None, context: int) -> int:
    """Tokens a head may attend to at this context length; None means all of them."""
    if budget is None:
        return context
    if isinstance(budget, float):
        return max(1, math.ceil(budget * context))
    return budget


def budget_tokens(budget: int | float | None, n: torch.Tensor) -> torch.Tensor:
    """`resolve_budget` for context lengths n [b] on the device (no value read back)."""
    if budget is None:
        return n
    if isinstance(budget, float):
        return torch.ceil(n.double() * budget).long().clamp(min=1)
    return torch.full_like(n, budget)


def validate_budget(budget: Any) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise SemkvError(f"budget={budget!r} must be an int (tokens) or a float in (0, 1] (fraction of the context)")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise SemkvError(f"budget={budget} as a fraction must be in (0, 1]; give an int for a number of tokens")
    if isinstance(budget, int) and not 0 < budget <= INT_MAX:
        raise SemkvError(f"budget={budget} must be a positive number of tokens (at most {INT_MAX})")


class BatchedHooks:
    """Fast-path and admission hooks: defaults for a method that keeps nothing beside the KV pool and selects layer
    by layer."""

    # True when `select` and `plan_selection` work from DecodeBatch tensors alone (no per-sequence Python state, no
    # reads of device values), so the decode step can be captured in a CUDA graph. `begin_step` and `step_plan` run
    # on the host before the forward and may use per-sequence state.
    graph_safe: ClassVar[bool] = False
    # True when its captured decode steps read no buffer the method holds (the Full-KV step over the pool and the
    # engine's own buffers): a server (`Session`) keeps its graphs while no request uses it, instead of capturing
    # them again (about 70 ms a batch size on an H200) when the next request comes.
    idle_graphs: ClassVar[bool] = False
    # Bumped by a method that reallocates device buffers its captured steps point at: graphs are captured again.
    graph_epoch: int = 0

    @property
    def steady_slots(self) -> bool:
        """False when `end_step` may move a request's cached slots (offloading the oldest recent tokens): the engine
        then prepares no step ahead, since the slots it would name could move."""
        return True

    @property
    def plans_ahead(self) -> bool:
        """True when its `step_plan` may run before the last step is ended: nothing in it depends on that step's
        tokens, a host count of them or what its `end_step` does (`observe_logits` runs as a step is launched, before
        the next one's plan either way). Its decode steps may then be pipelined (`Engine.pipelines`), as those of a
        method without these hooks."""
        return False

    def admit(self, seq: "Sequence") -> None:
        """Take the device memory the request's state needs beside the KV pool (rows of batched tensors); called by
        the engine when the request is admitted, before its prefill."""
        return None

    def admission_bytes(self, seq: "Sequence") -> int:
        """Device bytes beside the KV pool that `admit(seq)` allocates now; the engine admits the request only when
        they are free."""
        return 0

    def batch_state_bytes(self, seq: "Sequence", batch: int) -> int:
        """Device bytes beside the KV pool that `batch` requests like `seq` hold at once (`semkv bench --batches
        max` fits them in the state room, with `page_state_bytes` for each page they hold): what each request's
        admission allocates."""
        return batch * self.admission_bytes(seq)

    def page_state_bytes(self, pool: "KVPool") -> int:
        """Device bytes of state the method keeps by physical page beside the pool, per page (Quest's and CHESS's
        page summaries, InfLLM's block keys, H2O's scores: `KVPool.page_states`); the pool grows it with the pages
        ever handed out, and admission counts it for the pages a request adds."""
        return 0

    def admission_host_bytes(self, seq: "Sequence") -> int:
        """Host bytes `admit(seq)` allocates for the request's offloaded K/V; the engine admits it only when the host
        has them free."""
        return 0

    def device_tokens(self, prompt_tokens: int, max_new_tokens: int, page_size: int) -> int | None:
        """The most slots one layer of a request holds on the device once prefilled (its prefill holds the whole
        prompt), for a prompt and generation of these lengths and pages of `page_size` slots; None: every token
        (Full KV). Admission and `semkv bench --batches max` count pages with it."""
        return None

    def release(self, seq: "Sequence") -> None:
        """The request ended (finished, stopped, failed or cancelled): forget what is kept for it on this object
        (its row of batched state, plans that name it). The engine then frees its pages and drops
        `seq.method_state`."""
        return None

    def reset(self) -> None:
        """The run ended, however it ended: drop every buffer kept for its requests (state beside the pool, cached
        plans), so the memory is free even while something (a traceback) still refers to this object. It stays
        usable: buffers are made again on demand. `bind` calls it first, so it is where a method makes its empty
        state. The engine measures what is left (`engine.memory`)."""
        return None

    def step_plan(self, batch: DecodeBatch) -> StepPlan | None:
        """The step's per-sequence decisions, made on the host before the forward (it may use per-sequence state;
        it sees the batch without page tables), from which `plan_selection` computes one selection for every layer
        (CHESS), or which `select` reads from `batch.step_plan` (rows of per-sequence device state). None: no plan."""
        return None

    def plan_buffers(self, size: int, max_slots: int, device: torch.device) -> StepPlan | None:
        """Static buffers of this method's plan for a CUDA graph of `size` rows and sequences of at most `max_slots`
        slots (`StepPlan.static`); None: the method makes no plan."""
        return None

    def plan_selection(self, batch: DecodeBatch, plan: StepPlan) -> Selection | None:
        """The step's selection from the plan and the batch tensors alone (captured in the CUDA graph). None: `select`
        runs per layer."""
        return None

    def observe_logits(self, seqs: list["Sequence"], logits: torch.Tensor) -> None:
        """Right after a decode step's forward is queued, before its tokens are read back: the logits [B, vocab] are
        not computed yet, so work queued on them overlaps the forward (reading a value back waits for it)."""
        return None


@dataclass
class KVMethod(BatchedHooks):
    """Base of every method. Defaults implement Full KV: keep and attend to everything."""

    budget: int | float | None = None

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    # How the budget binds, checked by the shared test matrix:
    #   "full": no budget; "prefill_eviction": the prompt is compressed to the budget, generated tokens are appended;
    #   "decode_eviction": resident tokens never exceed the budget; "selection": every step attends to <= budget.
    kind: ClassVar[str] = "full"
    # True when `observe_prefill` wants the log-sum-exps of the chunk's attention
    prefill_lse: ClassVar[bool] = False
    # Old parameter names still accepted by `get_method` (with a DeprecationWarning): old -> new.
    renamed: ClassVar[dict[str, str]] = {}
    model: ClassVar[Any] = None  # the model's ModelConfig, set on the bound copy by `bind`

    @property
    def tp(self) -> Any:
        """This rank's `models.parallel.TensorParallel` when the model is sharded over GPUs, else None (also before
        `bind`): scores a layer's heads share are reduced over the ranks with it (`parallel.over_heads`)."""
        return None if self.model is None else self.model.tp

    def __post_init__(self) -> None:
        validate_budget(self.budget)

    # -- set-up ---------------------------------------------------------------------------------------------------
    def bound(self, model: "ModelConfig", tokenizer: Any, page_size: int) -> "KVMethod":
        """A private copy of this method, bound to a model for one run: the object a user made keeps its parameters
        only, and the state the run keeps beside the pool lives on the copy the engine holds."""
        method = dataclasses.replace(self) if dataclasses.is_dataclass(self) else copy.copy(self)
        method.bind(model, tokenizer, page_size)
        return method

    def bind(self, model: "ModelConfig", tokenizer: Any, page_size: int) -> None:
        """Called on the bound copy before a generation with the model's shape, its tokenizer (e.g. to find
        delimiter tokens) and the engine's KV page size."""
        self.model, self.tokenizer, self.kv_page_size = model, tokenizer, page_size
        self.reset()

    def new_state(self, seq: "Sequence") -> Any:
        """The request's state, made when it is submitted (host side: requests may wait long before they run)."""
        return None

    @classmethod
    def calibrate(cls, llm: Any, texts: list[str], max_tokens: int) -> dict[str, Any]:
        """Offline calibration on `texts` (each cut to `max_tokens`) for the model of `llm`; the returned dict is
        saved by `semkv calibrate` (see `methods/calibration.py`) and read back in `bind`."""
        raise SemkvError(f"method {cls.name!r} has nothing to calibrate")

    # -- prefill --------------------------------------------------------------------------------------------------
    def window_size(self) -> int:
        """How many trailing prompt queries `evict_prefill` needs (the engine keeps them in the last chunk)."""
        return 0

    def rope_by_rank(self) -> bool:
        """True when keys are stored before RoPE and attention rotates each attended key by its rank in the attended
        list (and the query by its own rank), so positions stay below the attended length (length extrapolation).
        The hooks then see queries before RoPE; a method in this mode must attend to the current token (its rank is
        the query's). False (the default): keys are stored after RoPE with their absolute positions."""
        return False

    def prefill_chunk(self) -> int | None:
        """The longest prefill chunk the method allows, where its prefill depends on the chunks (TokenSelect selects
        the context of each chunk); the engine's chunk when shorter. None: no limit."""
        return None

    def prefill_by_layer(self) -> bool:
        """True: a prompt of several chunks is prefilled layer after layer (every chunk through layer l before any
        through layer l + 1), so each layer's whole prompt is evicted or offloaded before the next layer's is
        computed and the device holds one layer's prompt at a time, not every layer's (the offloading methods). The
        same computation in another order, for the price of the prompt's hidden states ([T, hidden] twice)."""
        return False

    def uses_question_split(self) -> bool:
        """True when prefill-time compression must run before the question is read (query-agnostic mode)."""
        return False

    def own_prefill(self, has_question: bool) -> bool:
        """True when the method changes or watches prefill itself, so it cannot start from a shared Full-KV prefill."""
        hooks = ("prefill_context", "observe_prefill")
        overridden = any(getattr(type(self), h) is not getattr(KVMethod, h) for h in hooks)
        return overridden or (has_question and self.uses_question_split())

    def shares_prefix(self, seq: "Sequence") -> bool:
        """True when the request may start from prompt pages another request computed, and give its own to the
        prefix cache: its prefill computes the prompt's K/V as Full KV does and does not watch it (not
        `own_prefill`, keys stored after RoPE, no prefill by layer), and its decode steps write only slots of their
        own (no `begin_step`). Prefill eviction qualifies: its compaction moves to pages of its own first."""
        return not (self.own_prefill(seq.question_start is not None) or self.rope_by_rank()
                    or self.prefill_by_layer() or type(self).begin_step is not KVMethod.begin_step
                    or type(self).observe_prefill is not KVMethod.observe_prefill)

    def prefill_context(self, layer: int, seq: "Sequence", q: torch.Tensor, start: int) -> torch.Tensor | None:
        return None

    def observe_prefill(self, layer: int, seq: "Sequence", q: torch.Tensor, start: int,
                        lse: torch.Tensor | None) -> None:
        """See each prefill chunk after its attention: q [C, heads, D] (after RoPE) of tokens stored at slots
        [start, start + C); lse [C, heads] float32, the log-sum-exp of each query's logits `scale * q . k` over the
        keys it attended to, when the method sets `prefill_lse` (else None): the attention kernel's by-product, so
        that attention probabilities cost no second softmax pass."""
        return None

    def evict_prefill(self, layer: int, seq: "Sequence", q_window: torch.Tensor) -> torch.Tensor | None:
        return None

    def evict_prefill_layers(self, seq: "Sequence", q_windows: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """`evict_prefill` of every layer, after the forward of a prompt's last chunk that ran packed with others
        (`PackedPrefillStep`): each layer's window queries q_windows, [w, heads, D] each -> each layer's slots to keep
        (None: all)."""
        return [self.evict_prefill(layer, seq, q) for layer, q in enumerate(q_windows)]

    def finish_prefill(self, seq: "Sequence") -> None:
        return None

    # -- decode ---------------------------------------------------------------------------------------------------
    def begin_step(self, batch: DecodeBatch) -> torch.Tensor | None:
        return None

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        return None

    def end_step(self, seqs: list["Sequence"], logits: torch.Tensor, tokens: list[int]) -> None:
        """After a decode step: its logits [B, vocab] and the chosen next tokens of the batch's sequences."""
        return None

    # -- description ----------------------------------------------------------------------------------------------
    @classmethod
    def parameters(cls) -> dict[str, Any]:
        """Parameter name -> default, for `semkv methods`."""
        return {
            f.name: f.default_factory() if f.default is MISSING else f.default
            for f in fields(cls)
            if f.init and not f.name.startswith("_")
        }
