"""Next-token choice: greedy, or temperature / top-k / top-p sampling with each request's own seeded generator."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from semkv.engine.sequence import SamplingParams, TokenLogprob
from semkv.engine.staging import copy_early


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """logits [vocab] (float32) -> token id. Filters apply in the order transformers uses: temperature, top-k, top-p."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    logits = logits.cpu().double()  # in float64, shifted first: no inf or nan from any temperature > 0
    logits = (logits - logits.max()) / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) > params.top_p  # keep the token crossing top_p
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Choice:
    """Several requests' next tokens under way (`choose_each`): the greedy requests' tokens chosen on the device and
    being copied to the host, the others to be sampled on the host (`chosen`)."""

    logits: list[torch.Tensor]  # [vocab] each
    params: list[SamplingParams]
    generators: list[torch.Generator]
    greedy: list[int]  # the indices of the greedy requests
    tokens: torch.Tensor | None  # [len(greedy)] their tokens (pinned host memory on CUDA), or None when none
    ready: torch.cuda.Event | None  # recorded after the copy (None: the copy is done)


def choose_each(logits: list[torch.Tensor], params: list[SamplingParams],
                generators: list[torch.Generator]) -> Choice:
    """`sample` for several requests (logits [vocab] each), started: the greedy requests' tokens chosen together on
    the device and copied to the host without waiting for it, so the host may queue more work before it reads them
    (`chosen`: one wait for all of them, not one a request)."""
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    tokens, ready = None, None
    if greedy:
        tokens, ready = copy_early(torch.stack([logits[i] for i in greedy]).argmax(-1))
    return Choice(logits, params, generators, greedy, tokens, ready)


def chosen(choice: Choice) -> list[int]:
    """The tokens of a `choose_each`: its greedy ones once their copy is done, the others sampled now."""
    tokens = [0] * len(choice.logits)
    if choice.ready is not None:
        choice.ready.synchronize()
    if choice.tokens is not None:
        for i, token in zip(choice.greedy, choice.tokens.tolist()):
            tokens[i] = token
    for i, p in enumerate(choice.params):
        if p.temperature > 0:
            tokens[i] = sample(choice.logits[i], p, choice.generators[i])
    return tokens


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of `token` under logits [vocab] and the `top` most likely tokens with theirs."""
    logprobs = torch.log_softmax(logits.float(), -1)
    values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
    return TokenLogprob(float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))
