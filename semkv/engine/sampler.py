"""Next-token choice: greedy, or temperature / top-k / top-p sampling with each request's own seeded generator."""
from __future__ import annotations

import torch

from semkv.engine.sequence import SamplingParams, TokenLogprob


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


def sample_each(logits: list[torch.Tensor], params: list[SamplingParams],
                generators: list[torch.Generator]) -> list[int]:
    """`sample` for several requests (logits [vocab] each): the greedy ones' tokens read from the device together,
    one wait for all of them instead of one a request."""
    tokens = [0] * len(logits)
    greedy = [i for i, p in enumerate(params) if p.temperature <= 0]
    if greedy:
        for i, token in zip(greedy, torch.stack([logits[i] for i in greedy]).argmax(-1).tolist()):
            tokens[i] = token
    for i, p in enumerate(params):
        if p.temperature > 0:
            tokens[i] = sample(logits[i], p, generators[i])
    return tokens


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The log-probability of `token` under logits [vocab] and the `top` most likely tokens with theirs."""
    logprobs = torch.log_softmax(logits.float(), -1)
    values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
    return TokenLogprob(float(logprobs[token]), list(zip(ids.tolist(), values.tolist())))
