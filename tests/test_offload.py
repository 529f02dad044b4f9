"""HostKVStore: what goes in is where a kernel reads it, per layer and head, within a fixed capacity, in one
page-aligned buffer of exactly its size; and the engine admits offloading requests by what they hold on the device
and in host memory."""
import pytest
import torch

import semkv
from semkv.engine.offload import HOST_PAGE, HostKVStore, token_bytes
from semkv.errors import SemkvError
from semkv.methods import SentenceKV


def test_put_appends_per_layer_within_the_capacity():
    store = HostKVStore(2, 3, 8, 12, torch.float32, torch.device("cpu"))
    k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    pos = torch.arange(10, dtype=torch.int32).repeat(2, 3, 1)
    store.put(slice(0, 1), k[:1, :, :6], v[:1, :, :6], pos[:1, :, :6])  # layer 0 alone (prefill, layer by layer)
    store.put(slice(1, 2), k[1:, :, :6], v[1:, :, :6], pos[1:, :, :6])
    store.put(slice(None), k[:, :, 6:], v[:, :, 6:], pos[:, :, 6:])  # every layer at once (decode)
    assert store.size(0) == store.size(1) == 10
    assert torch.equal(store.k[:, :, :10], k) and torch.equal(store.v[:, :, :10], v)
    assert torch.equal(store.pos[:, :, :10], pos)
    assert store.d2h_bytes == 2 * k.numel() * 4
    with pytest.raises(SemkvError, match="do not fit"):
        store.put(slice(None), k[:, :, :3], v[:, :, :3], pos[:, :, :3])
    fresh = HostKVStore(2, 3, 8, 12, torch.float32, torch.device("cpu"))
    fresh.put(slice(0, 1), k[:1, :, :2], v[:1, :, :2], pos[:1, :, :2])
    with pytest.raises(SemkvError, match="do not fit"):  # layers holding different counts
        fresh.put(slice(None), k[:, :, :1], v[:, :, :1], pos[:, :, :1])


def test_one_page_aligned_buffer_of_exactly_its_size():
    store = HostKVStore(3, 2, 16, 100, torch.bfloat16, torch.device("cpu"))
    assert store.k.data_ptr() % HOST_PAGE == 0
    assert store.v.data_ptr() == store.k.data_ptr() + store.k.nbytes  # one buffer: one pin, one address table
    assert store.pos.data_ptr() == store.v.data_ptr() + store.v.nbytes
    size = 3 * 100 * token_bytes(2, 16, torch.bfloat16)
    assert size == store.k.nbytes + store.v.nbytes + store.pos.nbytes
    assert store.buffer.nbytes - HOST_PAGE < size + HOST_PAGE
    k_ptr, v_ptr, pos_ptr, capacity = store.pointers()
    assert (k_ptr, v_ptr, pos_ptr, capacity) == (store.k.data_ptr(), store.v.data_ptr(), store.pos.data_ptr(), 100)


def test_offloading_requests_are_admitted_by_their_device_footprint(tiny_model_dir, monkeypatch):
    """A pool too small for two prompts under the Full-KV bound runs four offloading SentenceKV requests at once
    (each holds its budget on the device once prefilled), with the tokens of the unlimited run, and frees everything
    after; a request whose offloaded K/V do not fit the host's memory is refused with a message that says so."""
    from tests.test_engine import PROMPTS

    class Recorded(SentenceKV):
        def step_plan(self, batch):
            sizes.append(len(batch.seqs))
            return super().step_plan(batch)

    sizes: list[int] = []
    prompts = [PROMPTS[0] * 3] * 4
    params = dict(budget=48, n_sink=4, n_recent=4, offload=True)
    big = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    n = len(big.tokenizer(prompts[0])["input_ids"])
    layers, page = big.config.num_layers, big.engine.pool.page_size
    bound = SentenceKV(**params).device_tokens(n, 8, page)
    # sinks, the working set (1.5 x the 40 selected, in whole pages), recent window, a page leaving
    assert bound == 4 + 60 + 4 + 16
    # four at their bound, but the last one's prefill (one chunk) holds one layer's whole prompt instead of its bound
    pages = 4 * layers * -(-bound // page) - -(-bound // page) + -(-n // page)
    assert pages < 2 * layers * -(-(n + 8) // page)  # the Full-KV bound would not admit two
    small = semkv.LLM(tiny_model_dir("llama"), device="cpu", num_pages=pages + 1)
    kw = dict(max_new_tokens=8, ignore_eos=True, chat=False)
    got = small.generate(prompts, method=Recorded(**params), **kw)
    assert max(sizes) == 4
    assert [o.token_ids for o in got] == [o.token_ids for o in big.generate(prompts, method=SentenceKV(**params),
                                                                            **kw)]
    assert small.engine.memory().held == (0, 0, 0, 0)
    monkeypatch.setattr("semkv.engine.engine.available_host_bytes", lambda: 1000.0)
    with pytest.raises(MemoryError, match="GiB of host memory for its offloaded K/V"):
        small.generate(prompts[:1], method=SentenceKV(**params), **kw)
    assert small.engine.memory().held == (0, 0, 0, 0)
