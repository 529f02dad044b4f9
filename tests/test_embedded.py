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
