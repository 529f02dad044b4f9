"""End to end on the embedded SmolLM2-135M-Instruct: token-for-token parity with HF transformers' generate."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_greedy_parity_with_transformers_at_2k(smol_llm, embedded_folder, essay_text):
    from transformers import AutoModelForCausalLM

    ids, _ = smol_llm.encode(essay_text[:9000], None, chat=True)
    assert 1900 <= len(ids) <= 2400
    ours = smol_llm.generate(essay_text[:9000], max_new_tokens=64, ignore_eos=True)[0]
    assert ours.prompt_token_ids == ids
    hf = AutoModelForCausalLM.from_pretrained(embedded_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    assert ours.token_ids == ref[0, len(ids):].tolist()


def test_answers_a_question_about_a_document(smol_llm, essay_text):
    needle = " The secret passkey is 73914. Remember it. "
    doc = essay_text[:3000] + needle + essay_text[3000:6000]
    out = smol_llm.generate(doc, questions=["What is the secret passkey? Answer with the number only."],
                            max_new_tokens=16)[0]
    assert "73914" in out.text


@pytest.mark.parametrize("name, params", [
    ("sentencekv", dict(budget=256)),
    ("dynsplit", dict(budget=256, offload_chunk=8)),
])
def test_offloaded_methods_give_the_resident_tokens(smol_llm, essay_text, name, params):
    """SentenceKV and DynSplit-KV with their K/V in host memory give, on real weights, the tokens of the same method
    with K/V resident, for a batch of two documents (continuous batching, the working set reused across steps),
    while holding far fewer slots on the device; nothing stays behind."""
    from semkv.methods import get_method

    docs = [essay_text[:6000], essay_text[6000:13000]]
    kw = dict(questions=["Summarise the text in one sentence."] * 2, max_new_tokens=24, ignore_eos=True)
    resident = smol_llm.generate(docs, method=get_method(name, **params, offload=False), **kw)
    offload = smol_llm.generate(docs, method=get_method(name, **params, offload=True), **kw)
    assert [o.token_ids for o in offload] == [o.token_ids for o in resident]
    for on, off in zip(offload, resident):
        assert on.stats.h2d_bytes > 0 and on.stats.extra["kv_reused"] > 0
        assert on.stats.kv_resident_tokens < off.stats.kv_resident_tokens
    assert smol_llm.engine.memory().held == (0, 0, 0, 0)


@pytest.mark.parametrize("name, params", [
    ("sentencekv", dict(budget=256)),
    ("dynsplit", dict(budget=256, offload_chunk=8)),
])
def test_a_larger_working_set_reads_less_from_the_host(smol_llm, essay_text, name, params):
    """With twice the working-set slots a step selects, tokens that left the selection stay on the device until
    their slot is needed: on real weights the same tokens, fewer offloaded tokens read from the host, more found."""
    from semkv.methods import get_method

    kw = dict(questions=["Summarise the text in one sentence."], max_new_tokens=24, ignore_eos=True)
    runs = [smol_llm.generate(essay_text[:9000], method=get_method(name, **params, offload=True, cache_factor=f),
                              **kw)[0] for f in (1.0, 2.0)]
    assert runs[0].token_ids == runs[1].token_ids
    (one, two) = (r.stats for r in runs)
    assert two.extra["kv_reloaded"] < one.extra["kv_reloaded"] and two.h2d_bytes < one.h2d_bytes
    assert two.extra["kv_reused"] > one.extra["kv_reused"]
    assert two.kv_resident_tokens > one.kv_resident_tokens
    assert smol_llm.engine.memory().held == (0, 0, 0, 0)
