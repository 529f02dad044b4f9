"""The evaluation runner on a tiny random model: shared prefill equals separate runs, resumability (rerun, extension,
kill and resume), config.json reproduces a run, perplexity rows, selection diagnostics in the rows, and bad
input."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from semkv.cli.main import main
from semkv.errors import SemkvError
from semkv.eval import report, run, run_config
from semkv.eval.lengths import n_tokens
from semkv.eval.perplexity_data import book_text
from semkv.eval.task import prompt_text
from semkv.eval.tasks import get_task
from semkv.eval.store import ResultsDir, row_key
from semkv.methods import get_method

from conftest import FIXTURES

GRID = dict(tasks=["passkey"], methods=["full", "streaming_llm", "snapkv", "quest"], budgets=[24], lengths=[192],
            samples=2, seed=3)


@pytest.fixture(scope="module")
def clean_run(tiny_llm, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    rows = run(**GRID, out=str(out), llm=tiny_llm, progress=False)
    return out, rows


def test_rows_cover_the_grid(clean_run, tiny_llm):
    out, rows = clean_run
    template = len(tiny_llm.encode("x", chat=True)[0]) - 1  # the chat template's tokens around the prompt
    assert len(rows) == 2 * (1 + 3)  # samples x (full + 3 methods x 1 budget)
    assert {(r["method"], r["budget"]) for r in rows} == {("full", None), ("streaming_llm", 24), ("snapkv", 24),
                                                          ("quest", 24)}
    for r in rows:
        assert 0 <= r["score"] <= 100 and isinstance(r["prediction"], str)
        assert abs(r["stats"]["prompt_tokens"] - template - 192) <= 0.02 * 192  # the task hits the length
        diag = r["diag"]  # passkey has a needle: retention, and recall against Full KV
        assert 0 <= diag["retention"] <= 1 and 0 <= diag["recall"] <= 1 and 0 <= diag["mass_recall"] <= 1
        assert len(diag["layers_retention"]) == tiny_llm.config.num_layers
        if r["method"] == "full":
            assert diag["retention"] == diag["recall"] == diag["mass_recall"] == 1.0
        if r["method"] != "full":
            assert r["stats"]["kv_attended_max"] <= 24 + r["stats"]["new_tokens"]


def test_shared_prefill_equals_separate_runs(clean_run, tiny_llm):
    _, rows = clean_run
    task = get_task("passkey")
    samples = {s.sample_id: s for s in task.samples(tiny_llm.tokenizer, 192, 2, 3)}
    for r in rows:
        s = samples[r["sample_id"]]
        assert s.answer_prefix == "The pass key is" and abs(n_tokens(tiny_llm.tokenizer, prompt_text(s)) - 192) <= 4
        alone = tiny_llm.compare(s.context, [get_method(r["method"], r["budget"])], s.question, task.max_new_tokens,
                                 task.chat, answer_prefix=s.answer_prefix)[0]
        assert alone.prompt_token_ids[-len(tiny_llm.tokenizer(" pass key is")["input_ids"]):] == \
            tiny_llm.tokenizer(" pass key is")["input_ids"]  # the answer prefix ends the prompt
        assert alone.text == r["prediction"], r["method"]


def test_variants_of_a_method_are_arms_of_one_run(clean_run, tiny_llm, tmp_path):
    """"snapkv[kernel_size=1,pooling=max]" is its own arm beside "snapkv": rows, resolved parameters and report; its
    predictions are that setting's (equal to running it as the method with those parameters)."""
    _, base = clean_run
    variant = "snapkv[kernel_size=1,pooling=max]"
    rows = run(**(GRID | dict(methods=["full", "snapkv", variant])), out=str(tmp_path), llm=tiny_llm, progress=False)
    assert {r["method"] for r in rows} == {"full", "snapkv", variant} and len(rows) == 6
    resolved = ResultsDir(tmp_path).config()["resolved"]["methods"]
    assert resolved[f"{variant}@24"]["kernel_size"] == 1 and resolved["snapkv@24"]["kernel_size"] == 5
    run(**(GRID | dict(methods=["quest"])), out=str(tmp_path), llm=tiny_llm, progress=False)  # the run grows
    assert set(ResultsDir(tmp_path).config()["resolved"]["methods"]) == {"full", "snapkv@24", f"{variant}@24",
                                                                          "quest@24"}
    task = get_task("passkey")
    samples = {s.sample_id: s for s in task.samples(tiny_llm.tokenizer, 192, 2, 3)}
    for r in rows:
        if r["method"] == variant:
            s = samples[r["sample_id"]]
            alone = tiny_llm.compare(s.context, [get_method("snapkv", 24, kernel_size=1, pooling="max")], s.question,
                                     task.max_new_tokens, task.chat, answer_prefix=s.answer_prefix)[0]
            assert alone.text == r["prediction"]
    same = {(r["sample_id"], r["method"]): r["prediction"] for r in base}
    assert all(r["prediction"] == same[r["sample_id"], r["method"]] for r in rows if r["method"] != variant)
    path, _ = report.write_report(tmp_path)
    assert f"| {variant} | 24 |" in path.read_text()


def test_an_entry_with_its_own_budget_runs_at_that_budget_only(clean_run, tiny_llm, tmp_path):
    """"quest@40" runs Quest at 40 tokens beside the run's budgets (a method's recommended setting in the same run):
    its rows are method "quest" at budget 40, as a run with budgets [40] makes them, and the others keep the run's
    budget (bad entries: `test_eval_bad_input`)."""
    _, base = clean_run
    rows = run(**(GRID | dict(methods=["full", "snapkv", "quest@40"])), out=str(tmp_path), llm=tiny_llm,
               progress=False)
    assert {(r["method"], r["budget"]) for r in rows} == {("full", None), ("snapkv", 24), ("quest", 40)}
    alone = run(**(GRID | dict(methods=["quest"], budgets=[40])), out=str(tmp_path / "alone"), llm=tiny_llm,
                progress=False)
    at_40 = {r["sample_id"]: r["prediction"] for r in alone}
    assert all(r["prediction"] == at_40[r["sample_id"]] for r in rows if r["method"] == "quest")
    same = {(r["sample_id"], r["method"]): r["prediction"] for r in base}
    assert all(r["prediction"] == same[r["sample_id"], "snapkv"] for r in rows if r["method"] == "snapkv")
    assert set(ResultsDir(tmp_path).config()["resolved"]["methods"]) == {"full", "snapkv@24", "quest@40"}
    only_own = run(**(GRID | dict(methods=["full", "quest@40"], budgets=[])), out=str(tmp_path), llm=tiny_llm,
                   progress=False)  # every non-full entry names its budget: no run budgets needed
    assert len(only_own) == len(rows)


def test_second_run_skips_finished_rows_and_extends(clean_run, tiny_llm, tmp_path):
    out, rows = clean_run
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    before = (copy / "predictions.jsonl").read_bytes()
    run(**GRID, out=str(copy), llm=tiny_llm, progress=False)
    assert (copy / "predictions.jsonl").read_bytes() == before  # nothing recomputed, nothing appended
    extended = run(**dict(GRID, methods=["full", "quest"], budgets=[24, 0.5]), out=str(copy), llm=tiny_llm,
                   progress=False)
    new = [r for r in extended if row_key(r) not in {row_key(x) for x in rows}]
    assert {(r["method"], r["budget"]) for r in new} == {("quest", 0.5)} and len(new) == 2
    assert (copy / "predictions.jsonl").read_bytes().startswith(before)
    config = json.loads((copy / "config.json").read_text())["run"]
    assert config["budgets"] == [24, 0.5] and config["methods"] == GRID["methods"]  # the union of both runs
    with pytest.raises(SemkvError, match="seed=3, not 4"):
        run(**dict(GRID, seed=4), out=str(copy), llm=tiny_llm, progress=False)


def test_batched_run_equals_one_by_one_and_records_its_speed(clean_run, tiny_llm, tmp_path):
    """Batched mode (the default on a GPU): each method runs both samples together through continuous batching;
    every row equals the one-by-one run's, and runs.jsonl holds each run's speed, consistent with its rows."""
    _, rows = clean_run
    out = tmp_path / "batched"
    batched = run(**GRID, out=str(out), llm=tiny_llm, progress=False, batched=True)
    strip = lambda rs: sorted((row_key(r), r["prediction"], r["score"]) for r in rs)  # noqa: E731
    assert strip(batched) == strip(rows)
    assert all("diag" not in r for r in batched)  # diagnostics need one eager sequence
    runs = ResultsDir(out).runs()
    assert sorted((r["method"], r["budget"]) for r in runs) == sorted({(r["method"], r["budget"]) for r in rows})
    for record in runs:
        mine = [r for r in batched if (r["method"], r["budget"]) == (record["method"], record["budget"])]
        assert record["samples"] == len(mine) == 2 and record["length"] == 192 and record["task"] == "passkey"
        assert record["new_tokens"] == sum(r["stats"]["new_tokens"] for r in mine)
        assert record["tokens_per_s"] == pytest.approx(record["new_tokens"] / record["wall_s"])
        assert record["tpot_ms"] > 0 and record["peak_memory_gib"] is None  # no device memory on the CPU
        assert record["attended"] == pytest.approx(sum(r["stats"]["kv_attended_tokens"] for r in mine) / 2)
    assert json.loads((out / "config.json").read_text())["run"]["batched"] is True
    run(**GRID, out=str(out), llm=tiny_llm, progress=False, batched=True)  # finished: nothing runs again
    assert len(ResultsDir(out).runs()) == len(runs)


def test_hf_generate_gives_full_kv_predictions_and_records_its_speed(tiny_llm, tmp_path, monkeypatch):
    """`hf=True` (batched): HF transformers' greedy generate on the prompt ids `LLM.generate` makes gives Full KV's
    predictions, token counts and attended KV (the correctness cross-check, on a budget-free run), and runs.jsonl has
    its speed; the rows resume like the others (a finished run does not even load HF's model); the report shows it."""
    from semkv.eval import runner

    out = tmp_path / "hf"
    grid = dict(GRID, methods=["full"], budgets=[])
    rows = run(**grid, out=str(out), llm=tiny_llm, progress=False, batched=True, hf=True)
    by_arm = {(r["method"], r["sample_id"]): r for r in rows}
    assert sorted(by_arm) == sorted((m, s) for m in ("full", "hf") for s in {r["sample_id"] for r in rows})
    for (method, sample_id), hf in by_arm.items():
        if method != "hf":
            continue
        full = by_arm[("full", sample_id)]
        assert hf["budget"] is None and hf["prediction"] == full["prediction"] and hf["score"] == full["score"]
        assert hf["finish_reason"] == full["finish_reason"]
        for key in ("prompt_tokens", "new_tokens", "kv_attended_tokens", "kv_resident_tokens", "kv_attended_max"):
            assert hf["stats"][key] == full["stats"][key], key
    runs = {r["method"]: r for r in ResultsDir(out).runs()}
    assert set(runs) == {"full", "hf"}
    record = runs["hf"]
    assert record["samples"] == 2 and record["budget"] is None and record["device"] == "cpu"
    assert record["new_tokens"] == runs["full"]["new_tokens"] and record["attended"] == runs["full"]["attended"]
    assert record["tokens_per_s"] > 0 and record["tokens_per_s"] == pytest.approx(record["new_tokens"] /
                                                                                  record["wall_s"])
    assert record["tpot_ms"] > 0 and record["peak_memory_gib"] is None  # no device memory on the CPU
    assert record["attention"] == "sdpa"  # transformers' default
    assert json.loads((out / "config.json").read_text())["run"]["hf"] is True

    def unloadable(*args):
        raise AssertionError("nothing is left for HF to run")

    monkeypatch.setattr(runner, "hf_model", unloadable)
    before = (out / "predictions.jsonl").read_bytes()
    run(**grid, out=str(out), llm=tiny_llm, progress=False, batched=True, hf=True)
    assert (out / "predictions.jsonl").read_bytes() == before and len(ResultsDir(out).runs()) == 2
    assert main(["report", str(out)]) == 0
    text = (out / "report.md").read_text()
    assert "| HF transformers | - |" in text  # the score table
    assert "| 192 | HF transformers |" in text  # the speed table
    assert (out / "plots" / "pareto_192.png").stat().st_size > 0


def test_hf_needs_batched_mode(tiny_llm, tmp_path, capsys):
    with pytest.raises(SemkvError, match=r"hf=True \(--hf\) needs batched mode"):
        run(**GRID, out=str(tmp_path / "lib"), llm=tiny_llm, progress=False, batched=False, hf=True)
    args = ["eval", "--device", "cpu", "--task", "passkey", "--methods", "full", "--lengths", "192", "--hf",
            "--out", str(tmp_path / "cli")]
    assert main(args) == 2  # on the CPU batched mode is not the default
    assert main(args + ["--no-batched"]) == 2
    err = capsys.readouterr().err
    assert err.count("semkv: error: hf=True (--hf) needs batched mode (batched=True, --batched") == 2, err
    assert not (tmp_path / "cli").exists()  # refused before anything ran


def test_config_json_reproduces_the_run(clean_run, tmp_path):
    out, rows = clean_run
    config = json.loads((out / "config.json").read_text())
    assert config["resolved"]["methods"]["snapkv@24"]["window"] == 32  # every parameter, defaults included
    assert {"semkv", "torch", "transformers"} <= set(config["resolved"]["versions"])
    again = run_config(out / "config.json", tmp_path / "again", progress=False)  # loads the model from the config
    strip = lambda rs: sorted((row_key(r), r["prediction"], r["score"]) for r in rs)  # noqa: E731
    assert strip(again) == strip(rows)


def test_kill_and_resume_leaves_no_duplicates(clean_run, tiny_model_dir, tmp_path):
    out, rows = clean_run
    args = [sys.executable, "-m", "semkv.cli.main", "eval", "--model", str(tiny_model_dir("llama")), "--device", "cpu",
            "--task", "passkey", "--methods", ",".join(GRID["methods"]), "--budgets", "24", "--lengths", "192",
            "--samples", "2", "--seed", "3", "--out", str(tmp_path)]
    predictions = tmp_path / "predictions.jsonl"
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    # kill at the first row: the tiny model writes the others within a fraction of a second
    while time.time() < deadline and proc.poll() is None and (
            not predictions.is_file() or predictions.read_text().count("\n") < 1):
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = predictions.read_text().count("\n")
    assert 1 <= written < len(rows)  # killed half way
    with open(predictions, "a") as f:
        f.write('{"task": "passkey", "length": 192, "sample_')  # a torn last line, as a kill mid-write leaves
    assert subprocess.run(args, capture_output=True).returncode == 0
    lines = predictions.read_text().splitlines()
    keys = [row_key(json.loads(line)) for line in lines]
    assert len(keys) == len(set(keys)) == len(rows)
    resumed = {row_key(r): r["prediction"] for r in ResultsDir(tmp_path).rows()}
    assert resumed == {row_key(r): r["prediction"] for r in rows}


def test_perplexity_rows_score_the_teacher_forced_continuation(tiny_llm, tmp_path):
    book = FIXTURES / "books" / "pg1661_adventures_of_sherlock_holmes.txt"
    (tmp_path / "data" / "books").mkdir(parents=True)
    shutil.copy(book, tmp_path / "data" / "books")
    rows = run(["perplexity"], ["full", "quest"], [32], [200], samples=1, data_dir=str(tmp_path / "data"),
               out=str(tmp_path / "out"), ppl_tokens=12, llm=tiny_llm, progress=False)
    from semkv.eval.perplexity import PerplexityTask

    body = book_text(book.parent, book.stem)
    assert "Sherlock" in body and not body.startswith("Produced by")
    assert not any(mark in body for mark in ("*** START", "*** END", "End of the Project Gutenberg", "Gutenberg-tm"))
    sample = PerplexityTask({book.stem: body}, 12).samples(tiny_llm.tokenizer, 200, 1, 0)[0]
    for r in rows:
        logprobs = tiny_llm.score_continuation(sample.meta["prefix_ids"], sample.meta["continuation_ids"],
                                               r["method"], r["budget"])
        assert r["tokens"] == 12 and r["nll"] == pytest.approx(-sum(logprobs), rel=1e-5)
    assert rows[0]["score"] != rows[1]["score"]  # quest at 32 tokens changes what is scored


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "nope"], "unknown task 'nope'; known: perplexity, infinitebench, ruler, longbench, passkey"),
        (["--task", "longbench_hotpotqa"], "task 'longbench_hotpotqa' reads data files: give data_dir"),
        (["--task", "passkey", "--methods", "full,nope"], "unknown method 'nope'"),
        (["--task", "passkey", "--methods", "snapkv[window]"], r"method 'snapkv\[window\]': 'window' must look like"),
        (["--task", "passkey", "--methods", "snapkv[nope=1]"], "unknown parameter"),
        (["--task", "passkey", "--methods", "snapkv["], "must be a method's name or a variant"),
        (["--task", "passkey", "--methods", "snapkv@lots"], "method 'snapkv@lots': budget 'lots' is not a number"),
        (["--task", "passkey", "--methods", "quest@1.5"], r"method 'quest@1.5': budget=1.5 as a fraction must be in"),
        (["--task", "passkey", "--methods", "full@24"], "method 'full@24': Full KV attends to every token"),
        (["--task", "passkey", "--lengths", "2x"], "length '2x' is not a token count"),
        (["--task", "passkey", "--lengths", "0"], "length '0' must be a whole positive number"),
        (["--task", "passkey", "--budgets", "abc"], "budget 'abc' is not a number"),
        (["--task", "passkey", "--budgets", "1.5"], r"budget=1.5 as a fraction must be in \(0, 1\]"),
        (["--task", "perplexity", "--data-dir", "/tmp"], "expected Project Gutenberg .txt files in /tmp/books"),
        (["--task", "passkey", "--data-dir", "/no/such/dir"], "data directory '/no/such/dir' does not exist"),
        (["--task", "passkey", "--param", "snapkv.nope=1"], "unknown parameter"),
        (["--task", "passkey", "--samples", "0"], "samples=0 must be an int >= 1"),
        ([], "give --task"),
    ],
)
def test_eval_bad_input(args, message, capsys):
    assert main(["eval", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("semkv: error: ") and "Traceback" not in err
    assert __import__("re").search(message, err), err


def test_report_bad_input(capsys, tmp_path):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["report", str(tmp_path)]) == 2
    assert "no results" in capsys.readouterr().err


def test_report_shows_bench_decode_speed_beside_quality(smol_llm, tmp_path, capsys):
    """`semkv report --bench DIR`: a `semkv bench` run's decode speed beside the scores of the same context length,
    method and budget (x Full KV in the same bench run, at the same batch), and a Pareto plot of the two; a folder
    without results.json is refused with its name. The embedded model, whose Full KV finds these passkeys."""
    from semkv.models.loader import embedded_model_path

    out, bench = tmp_path / "eval", tmp_path / "bench"
    rows = run(tasks=["passkey"], methods=["full", "snapkv"], budgets=[64], lengths=[512], samples=2, seed=3,
               out=str(out), llm=smol_llm, progress=False)
    assert any(r["method"] == "full" and r["score"] > 0 for r in rows)
    assert main(["bench", "--model", str(embedded_model_path()), "--device", "cpu", "--methods", "full,snapkv",
                 "--budget", "64", "--batches", "2", "--contexts", "512", "--steps", "2", "--out", str(bench)]) == 0
    assert main(["report", str(out), "--bench", str(bench)]) == 0
    text = (out / "report.md").read_text()
    section = text.split("## Decode speed (`semkv bench`) beside quality")[1].split("## Plots")[0]
    decode = {r["method"]: r for r in json.loads((bench / "results.json").read_text())["decode"]}
    share = report.relative_quality(rows)[(512, "snapkv", 64)]
    ratio = decode["snapkv"]["tokens_per_s"] / decode["full"]["tokens_per_s"]
    assert f"| 512 | snapkv@64 | 2 | {decode['snapkv']['tpot_ms']:.2f} |" in section
    assert f"| {ratio:.2f} (at 2) | {share:.1f} |" in section
    assert "| 1.00 (at 2) | 100.0 |" in section  # Full KV against itself
    assert (out / "plots" / "pareto_decode_512.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["report", str(out), "--bench", str(tmp_path)]) == 2
    assert f"--bench {str(tmp_path)!r}: no results.json there" in capsys.readouterr().err
