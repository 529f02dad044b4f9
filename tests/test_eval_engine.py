"""The engine paths the evaluation harness adds: teacher-forced scoring (perplexity) and the attention trace."""
from __future__ import annotations

import pytest
import torch

from semkv.engine.trace import Trace
from semkv.methods import get_method

TEXT = ("The harbour was quiet in the morning. Boats came back with fish, and the market opened at seven. " * 6
        + "A passkey is 30417. " + "Gulls circled the masts while the nets dried in the sun. " * 4)


@pytest.fixture(scope="module")
def token_ids(tiny_llm):
    return tiny_llm.tokenizer(TEXT, add_special_tokens=False)["input_ids"]


def test_teacher_forced_logprobs_equal_full_sequence_logits(tiny_llm, tiny_model_dir, token_ids):
    from transformers import AutoModelForCausalLM

    prefix, continuation = token_ids[:150], token_ids[150:180]
    ours = torch.tensor(tiny_llm.score_continuation(prefix, continuation))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prefix + continuation])).logits[0].float()
    reference = torch.log_softmax(logits, -1)[len(prefix) - 1 : -1].gather(1, torch.tensor(continuation)[:, None])
    assert ours.shape == (len(continuation),)
    torch.testing.assert_close(ours, reference[:, 0], atol=2e-4, rtol=1e-4)


def test_teacher_forcing_measures_the_method(tiny_llm, token_ids):
    prefix, continuation = token_ids[:150], token_ids[150:162]
    full = tiny_llm.score_continuation(prefix, continuation)
    for name in ("quest", "snapkv", "streaming_llm"):
        assert tiny_llm.score_continuation(prefix, continuation, name, 100_000) == pytest.approx(full, abs=1e-5)
        sparse = tiny_llm.score_continuation(prefix, continuation, name, 16)
        assert sparse[0] == pytest.approx(full[0], abs=1e-5)  # token 0 is scored by the prefill's logits
        assert max(abs(a - b) for a, b in zip(sparse, full)) > 1e-3
    assert tiny_llm.engine.pool.in_use == 0


def test_compare_with_continuation_equals_score_continuation(tiny_llm, token_ids):
    prefix, continuation = token_ids[:120], token_ids[120:130]
    methods = [get_method("full"), get_method("quest", 32), get_method("snapkv", 32)]
    outs = tiny_llm.compare(prefix, methods, continuation=continuation)
    for m, out in zip(methods, outs):
        assert out.token_ids == continuation
        assert out.logprobs == pytest.approx(tiny_llm.score_continuation(prefix, continuation, m), abs=1e-5)


def test_trace_with_full_kv_records_every_position(tiny_llm, token_ids):
    prefix = token_ids[:100]
    out = tiny_llm.compare(prefix, [get_method("full")], max_new_tokens=4, trace_steps=[0, 2])[0]
    trace, layers, heads = out.trace, tiny_llm.config.num_layers, tiny_llm.config.num_kv_heads
    assert sorted(trace.attended) == [0, 2]
    assert len(trace.resident) == layers and all(len(r) == heads for r in trace.resident)
    for layer in range(layers):
        for h in range(heads):
            assert trace.resident[layer][h].tolist() == list(range(100))
            assert trace.attended[0][layer][h].tolist() == list(range(101))  # the prompt and the fed token
            assert trace.attended[2][layer][h].tolist() == list(range(103))


def test_trace_follows_selection_and_eviction(tiny_llm, token_ids):
    prefix, budget = token_ids[:160], 32
    plain = tiny_llm.compare(prefix, [get_method("quest", budget), get_method("snapkv", budget)], max_new_tokens=6)
    quest, snap = tiny_llm.compare(prefix, [get_method("quest", budget), get_method("snapkv", budget)],
                                   max_new_tokens=6, trace_steps=None)
    assert quest.trace is None  # nothing asked
    quest, snap = tiny_llm.compare(prefix, [get_method("quest", budget), get_method("snapkv", budget)],
                                   max_new_tokens=6, trace_steps=range(6))
    assert [o.token_ids for o in plain] == [quest.token_ids, snap.token_ids]  # tracing changes nothing
    assert sorted(quest.trace.attended) == list(range(len(quest.token_ids) - 1))
    for layer, heads in enumerate(quest.trace.attended[0]):
        for h, attended in enumerate(heads):
            assert len(attended) <= budget and attended.tolist() == sorted(set(attended.tolist()))
            assert attended[-1] == len(prefix)  # the page of the current token is always attended
            assert quest.trace.resident[layer][h].tolist() == list(range(len(prefix)))
    for layer, heads in enumerate(snap.trace.resident):
        for h, resident in enumerate(heads):
            assert len(resident) == budget and resident.tolist() == sorted(resident.tolist())
            # after eviction a head attends to what it kept, plus the token being fed
            assert snap.trace.attended[0][layer][h].tolist() == resident.tolist() + [len(prefix)]


def test_trace_records_every_step_when_asked(tiny_llm, token_ids):
    from semkv.engine.kv_cache import SeqKV
    from semkv.engine.sequence import SamplingParams, Sequence

    method = get_method("streaming_llm", 24)
    method.bind(tiny_llm.config, tiny_llm.tokenizer, tiny_llm.engine.pool.page_size)
    seq = Sequence(0, token_ids[:60], SamplingParams(max_new_tokens=5, ignore_eos=True),
                   SeqKV(tiny_llm.engine.pool))
    seq.method_state, seq.trace = method.new_state(seq), Trace(steps=None)
    first = tiny_llm.engine.prefill(seq, method)
    tiny_llm.engine.generate([seq], method, [first], lambda s: "length" if len(s.output_ids) >= 5 else "")
    assert sorted(seq.trace.attended) == [0, 1, 2, 3]
    for step, layers in seq.trace.attended.items():
        window = layers[0][0].tolist()
        assert len(window) == 24 and window[:4] == [0, 1, 2, 3] and window[-1] == 60 + step
