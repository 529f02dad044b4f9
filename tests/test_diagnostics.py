"""Selection diagnostics on a tiny random model: Full KV retains the needle and has recall 1; a cache with the needle
dropped on chosen layers has retention 0 exactly there; recall equals a dense computation; `semkv inspect` writes its
table, heat map and HTML view."""
from __future__ import annotations

import types

import pytest
import torch
from matplotlib.image import imread

import semkv
from semkv.cli.main import main
from semkv.engine.trace import Trace, attention_probs
from semkv.eval import diagnostics
from semkv.methods import get_method

NEEDLE = "The pass key is 73914. Remember it."
PROMPT = "The grass is green. The sky is blue. " * 12 + NEEDLE + " Here we go. There and back again." * 10
QUESTION = "What is the pass key?"


def _run(llm, methods, inspect=None):
    return llm.compare(PROMPT, methods, QUESTION, 4, True, trace_steps=range(4), trace_weights=True, inspect=inspect)


def _requirements(llm):
    return diagnostics.prompt_requirements(llm, PROMPT, QUESTION, True, "", [NEEDLE], ["73914"])


def test_answer_span_is_the_answer_inside_the_needle(tiny_llm):
    (alternatives,) = _requirements(tiny_llm)
    ids, _ = tiny_llm.encode(PROMPT, QUESTION)
    (span,) = alternatives
    assert "73914" in tiny_llm.tokenizer.decode([ids[i] for i in span])
    assert "key" not in tiny_llm.tokenizer.decode([ids[i] for i in span])


def test_full_kv_has_retention_and_recall_one(tiny_llm):
    full, again = _run(tiny_llm, [get_method("full"), get_method("full")])
    maps = diagnostics.head_maps(again, full, None, _requirements(tiny_llm), len(full.prompt_token_ids))
    assert set(maps) == {"retention", "recall", "mass_recall"}
    for values in maps.values():
        assert torch.allclose(values, torch.ones_like(values))
    diag = diagnostics.summarize(maps)
    assert diag["retained_layers"] == tiny_llm.config.num_layers and diag["retention"] == 1.0
    for heads in full.trace.attention[0]:  # the probabilities are distributions over all prompt + generated tokens
        for probs in heads:
            assert probs.shape[1] == len(full.prompt_token_ids) + 1 and torch.allclose(probs.sum(1), torch.ones(1))


def test_dropping_the_needle_on_some_layers_gives_retention_zero_there(tiny_llm):
    span = _requirements(tiny_llm)[0][0]
    dropped = {0, 2}

    evictor = get_method("full")

    def drop(method, seq):  # evict the answer's tokens from the cache of the chosen layers, for `evictor` only
        if method is not evictor:
            return
        for layer in dropped:
            positions = seq.kv.positions(layer)[0].long()  # [n] (every head holds every position here)
            keep = torch.nonzero(~torch.isin(positions, span)).flatten()[None]  # [1, n_keep]
            seq.kv.compact({layer: keep})

    full, evicted = _run(tiny_llm, [get_method("full"), evictor], inspect=drop)
    maps = diagnostics.head_maps(evicted, full, None, _requirements(tiny_llm), len(full.prompt_token_ids))
    per_layer = maps["retention"].mean(1)
    for layer in range(tiny_llm.config.num_layers):
        assert per_layer[layer] == (0.0 if layer in dropped else 1.0)
    assert diagnostics.summarize(maps)["retained_layers"] == tiny_llm.config.num_layers - len(dropped)
    if evicted.token_ids[0] == full.token_ids[0]:  # the attention mass on the dropped tokens is missing
        assert (maps["mass_recall"][sorted(dropped)] < 1).all()


def test_streaming_llm_drops_a_middle_needle_everywhere(tiny_llm):
    full, stream = _run(tiny_llm, [get_method("full"), get_method("streaming_llm", 32)])
    maps = diagnostics.head_maps(stream, full, 32, _requirements(tiny_llm), len(full.prompt_token_ids))
    assert maps["retention"].sum() == 0 and diagnostics.summarize(maps)["retained_layers"] == 0


def test_chunked_attention_equals_dense():
    torch.manual_seed(0)
    q, keys = torch.randn(3, 16), torch.randn(50, 16)  # [g, D], [rows, D]
    rows = torch.randperm(50)[:37]
    dense = torch.softmax(q @ keys[rows].T * 0.25, dim=-1)
    assert torch.allclose(attention_probs(q, keys, rows, 0.25, chunk=5), dense, atol=1e-6)


def test_recall_equals_a_dense_computation():
    torch.manual_seed(1)
    layers, heads, group, n, k = 3, 2, 2, 40, 7
    probs = torch.softmax(torch.randn(layers, heads, group, n) * 2, dim=-1)  # Full KV's attention, dense
    chosen = torch.rand(layers, heads, n) < 0.4  # what the method attended
    positions = torch.arange(n)
    full = types.SimpleNamespace(token_ids=[5, 6], trace=Trace(frozenset({0})))
    full.trace.attended[0] = [[positions] * heads for _ in range(layers)]
    full.trace.attention[0] = [[probs[lay, h] for h in range(heads)] for lay in range(layers)]
    out = types.SimpleNamespace(token_ids=[5, 9], trace=Trace(frozenset({0})))
    out.trace.attended[0] = [[positions[chosen[lay, h]] for h in range(heads)] for lay in range(layers)]
    top, mass = diagnostics.recall(out, full, k)
    for lay in range(layers):
        for h in range(heads):
            expect_top, expect_mass = [], []
            for g in range(group):
                p = probs[lay, h, g]
                best = sorted(range(n), key=lambda i: -float(p[i]))[:k]
                expect_top.append(sum(float(p[i]) for i in best if chosen[lay, h, i]) / sum(float(p[i]) for i in best))
                expect_mass.append(sum(float(p[i]) for i in range(n) if chosen[lay, h, i]))
            assert float(top[lay, h]) == pytest.approx(sum(expect_top) / group, abs=1e-6)
            assert float(mass[lay, h]) == pytest.approx(sum(expect_mass) / group, abs=1e-6)
    out.token_ids = [4]  # another first token: no step with the same query, no recall
    assert diagnostics.recall(out, full, k) is None


def test_inspect_cli(tiny_model_dir, tmp_path, capsys):
    prompt = tmp_path / "doc.txt"
    prompt.write_text(PROMPT)
    args = ["inspect", "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--method", "snapkv",
            "--budget", "48", "--prompt-file", str(prompt), "--question", QUESTION, "--needle", NEEDLE,
            "--answer", "73914", "--steps", "3", "--max-new-tokens", "7", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "needle retained" in text and "top-k recall" in text and "\n  all " in text
    # the answers printed are whole (7 tokens), not cut at the 3 traced steps
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    answer = llm.compare(PROMPT, [get_method("full")], QUESTION, max_new_tokens=7)[0]
    assert len(answer.token_ids) == 7 and f"Full KV: {answer.text!r};" in text
    image = imread(tmp_path / "out" / "doc__snapkv.png")
    assert image.shape[0] > 300 and image[..., :3].std() > 0.05
    page = (tmp_path / "out" / "doc__snapkv.html").read_text()
    assert page.count("<section") == 2 and "snapkv@48" in page
    assert main(args[:-2] + ["--needle", "not in the prompt"]) == 2
