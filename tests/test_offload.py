"""HostKVStore: what goes in comes back, per head, with the bytes counted."""
import torch

from semkv.engine.offload import HostKVStore


def test_put_fetch_round_trip_per_head():
    store = HostKVStore(num_layers=2, device=torch.device("cpu"))
    k, v = torch.randn(3, 10, 8), torch.randn(3, 10, 8)
    pos = torch.arange(10).repeat(3, 1)
    store.put(1, k[:, :6], v[:, :6], pos[:, :6])
    store.put(1, k[:, 6:], v[:, 6:], pos[:, 6:])
    assert store.size(1) == 10 and store.size(0) == 0
    index = torch.tensor([[0, 9], [3, 4], [7, 7]])
    got_k, got_v, got_pos = store.fetch(1, index)
    rows = torch.arange(3)[:, None]
    assert torch.equal(got_k, k[rows, index]) and torch.equal(got_v, v[rows, index])
    assert torch.equal(got_pos, index.to(torch.int32))
    assert store.d2h_bytes == 2 * k.numel() * 4
    assert store.h2d_bytes == 2 * 3 * 2 * 8 * 4
    shared_k, _, _ = store.fetch(1, torch.tensor([[2, 5]]))
    assert torch.equal(shared_k, k[:, [2, 5]])


def test_appends_across_growth_keep_every_token():
    """Many small appends (the decode steps) after a large one (the prompt) grow the buffers in place; every token
    comes back from where it went in, and only the held tokens count."""
    store = HostKVStore(num_layers=1, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    parts = [700] + [1] * 300 + [50] * 3
    keys, values = torch.randn(2, sum(parts), 4, generator=gen), torch.randn(2, sum(parts), 4, generator=gen)
    start, capacities = 0, set()
    for m in parts:
        store.put(0, keys[:, start : start + m], values[:, start : start + m],
                  torch.arange(start, start + m).expand(2, -1))
        start += m
        capacities.add(store.k[0].shape[1])
    assert len(capacities) > 1 and store.size(0) == sum(parts)
    index = torch.randint(0, sum(parts), (2, 64), generator=gen)
    k, v, pos = store.fetch(0, index)
    heads = torch.arange(2)[:, None]
    assert torch.equal(k, keys[heads, index]) and torch.equal(v, values[heads, index]) and torch.equal(pos, index)
    assert store.nbytes() == 2 * keys.numel() * keys.element_size()
