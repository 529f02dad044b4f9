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
