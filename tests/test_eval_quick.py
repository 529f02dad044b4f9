"""End to end: `semkv eval --quick` on the embedded model over every method, then `semkv report`."""
from __future__ import annotations

import json

import pytest

from semkv.cli.main import main
from semkv.eval.runner import QUICK
from semkv.methods import METHODS

pytestmark = pytest.mark.slow


def test_quick_suite_and_report(tmp_path, capsys):
    out = tmp_path / "quick"
    # no --data-dir: passkey is synthetic, perplexity reads the installed RULER essays; the suite's shorter length and
    # one sample of each task only (options the suite takes like any other: 4.5 of the README's test command's 30
    # minutes with the preset's two samples, half that with one)
    assert main(["eval", "--quick", "--lengths", "512", "--samples", "1", "--device", "cpu", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "### passkey" in summary and "### perplexity" in summary
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    arms = 1 + (len(METHODS) - 1) * len(QUICK["budgets"])
    assert len(rows) == len(QUICK["tasks"]) * arms
    assert {r["length"] for r in rows} == {512}
    full = [r for r in rows if r["method"] == "full"]
    assert sum(r["score"] for r in full if r["task"] == "passkey") > 0  # the model finds some passkeys
    ppl = {r["sample_id"]: r["score"] for r in full if r["task"] == "perplexity"}
    assert all(1 < p < 1000 for p in ppl.values())  # a real language model on real prose
    assert main(["report", str(out)]) == 0
    assert (out / "plots" / "perplexity_vs_budget.png").stat().st_size > 10000
    pages = list((out / "html").glob("*.html"))
    assert len(pages) == len(QUICK["tasks"])
    assert all(page.stat().st_size < 1_000_000 for page in pages)  # every method of a 1k-token sample, 30 layers
