"""DynSplit-KV's host-offload placement (the paper's CPU-GPU setting) with KV reuse across steps.

All K/V of a sequence live in a `HostKVStore` (the prompt goes there at the end of prefill, each new token as it is
computed). Per layer, the device cache holds only a *region*: the tokens the current step attends to, in slots
[0, k) in ascending position order, so attention reads them exactly as the device-resident variant does (and a
budget covering the context gives Full KV bit for bit). The engine appends the new token after the region.

Reuse (the paper's Appendix B.2): a token selected again at the next step is already in the region and is not
fetched; only the misses cross the bus. The store fetches the same number of tokens for every KV head, so, as the
paper does, each head loads m = max over heads of its misses: its own misses plus some of its hits again.
"""
from __future__ import annotations

import torch

from semkv.engine.sequence import Sequence


def load_region(seq: Sequence, layer: int, wanted: torch.Tensor) -> None:
    """Make device slots [0, k) of `layer` hold positions `wanted` [kv_heads, k] (ascending per head), reusing the
    previous region (slots [0, r)) and the current token (slot r), fetching the rest from the host store."""
    state, kv = seq.method_state, seq.kv
    heads, k = wanted.shape
    current = len(state.ids) - 1
    now = torch.full((heads, 1), current, dtype=torch.long, device=wanted.device)
    resident = torch.cat([state.previous[layer], now], dim=1)  # [kv_heads, r + 1]: slot j holds resident[:, j]
    wanted = wanted.contiguous()
    slot = torch.searchsorted(resident, wanted).clamp(max=resident.shape[1] - 1)  # [kv_heads, k]
    hit = resident.gather(1, slot) == wanted
    missing = (~hit).sum(1)
    m = int(missing.max())
    load = torch.sort(hit.to(torch.int8), dim=1, stable=True).indices[:, :m]  # [kv_heads, m]: misses first
    keys, values, _ = kv.gather(layer, slot)  # [kv_heads, k, D]; stale where missed, replaced below
    if m:
        k_host, v_host, _ = state.store.fetch(layer, wanted.gather(1, load))
        index = load[..., None].expand(-1, -1, keys.shape[-1])
        keys, values = keys.scatter(1, index, k_host), values.scatter(1, index, v_host)
    kv.write(layer, torch.arange(k, device=wanted.device), keys.transpose(0, 1), values.transpose(0, 1), wanted.T)
    kv.truncate(layer, k)
    state.previous[layer] = wanted
    state.count(seq, reused=int((hit & (wanted != current)).sum()), reloaded=int(missing.sum()), fetched=heads * m)
