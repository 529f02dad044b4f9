"""Reports of a results directory (markdown tables, PNG plots) and the HTML view of a traced sample, rendered in
headless Chromium when it is installed."""
from __future__ import annotations

import json
import shutil

import pytest
from matplotlib.image import imread

from semkv.cli.main import main
from semkv.eval import html, run
from semkv.eval.store import ResultsDir


@pytest.fixture(scope="module")
def results(tiny_llm, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    run(["passkey"], ["full", "quest", "snapkv"], [24, 0.5], [168, 240], samples=2, out=str(out), llm=tiny_llm,
        trace_samples=1, progress=False)
    return out


def assert_real_png(path, min_bytes=5000):
    assert path.is_file() and path.stat().st_size > min_bytes
    image = imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 100
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_report_writes_tables_and_plots(results, capsys):
    assert main(["report", str(results)]) == 0
    text = (results / "report.md").read_text()
    for label in ("| full | - |", "| quest | 24 |", "| quest | 0.5 |", "| snapkv | 24 |", "| quest@0.5 |"):
        assert label in text
    assert "168 tok" in text and "240 tok" in text
    assert "needle kept (heads) | layers keeping needle | top-k recall | mass recall |" in text  # diagnostics columns
    assert capsys.readouterr().out.startswith("# Evaluation report")
    for name in ("passkey_vs_budget.png", "passkey_depth_heatmap.png"):
        assert_real_png(results / "plots" / name)
        assert f"plots/{name}" in text
    pages = sorted((results / "html").glob("*.html"))
    assert [p.name for p in pages] == ["passkey__passkey-168-s0-0-d0.html", "passkey__passkey-240-s0-0-d0.html"]


def test_trace_view_holds_every_method_and_the_needle(results, tiny_llm):
    view = ResultsDir(results).find_trace("passkey-240-s0-0-d0")
    assert set(view["methods"]) == {"full", "quest@24", "quest@0.5", "snapkv@24", "snapkv@0.5"}
    n, layers, heads = len(view["tokens"]), tiny_llm.config.num_layers, tiny_llm.config.num_kv_heads
    full, quest, snap = view["methods"]["full"], view["methods"]["quest@24"], view["methods"]["snapkv@24"]
    assert full["attended"] == [[heads] * n] * layers  # Full KV: every head attends every prompt token
    assert full["resident"] == [[heads] * n] * layers
    assert all(sum(line) <= heads * 24 for line in quest["attended"])  # the budget, per head and layer
    assert quest["resident"] == full["resident"]  # selection keeps everything stored
    assert all(sum(line) == heads * 24 for line in snap["resident"])  # eviction keeps the budget
    assert snap["attended"] == snap["resident"]  # and attends to what it kept
    page = html.render(view)
    assert page.count("<section") == 5 and "needle" in page
    data = json.loads(page.split('<script id="data" type="application/json">')[1].split("</script>")[0])
    assert data["tokens"] == view["tokens"] and data["needle"]  # the needle's tokens are marked
    needle_text = "".join(view["tokens"][i] for i in data["needle"])
    assert any(n in needle_text for n in view["needles"])
    for label, m in view["methods"].items():  # every layer's counts read back from the page's compact lines
        page_m = data["methods"][label]
        for key in ("attended", "resident"):
            want = m[key]
            got = (None if page_m[key] is None and key == "attended"
                   else [[heads] * n] * layers if page_m[key] is None
                   else [decode(page_m["rows"][j], n) for j in page_m[key]])
            assert got == want, (label, key)
    with pytest.raises(Exception, match="no trace"):
        ResultsDir(results).find_trace("passkey-240-s0-1-d100")


def decode(line: str, n: int) -> list[int]:
    """The page's layer line (`html._layer_line`): a character per token, chr(48 + count), or runs after '!'."""
    if not line.startswith("!"):
        return [ord(c) - 48 for c in line]
    out = []
    for part in line[1:].split(","):
        out += [ord(part[0]) - 48] * int(part[1:])
    assert len(out) == n
    return out


def test_report_for_one_sample_and_png(results, capsys):
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    assert main(["report", str(results), "--html", "passkey-168-s0-0-d0", "--png"]) == 0
    png = results / "html" / "passkey__passkey-168-s0-0-d0.png"
    assert_real_png(png, 20000)
    pixels = imread(png)[..., :3]
    orange = (pixels[..., 0] > 0.95) & (pixels[..., 1] > 0.5) & (pixels[..., 1] < 0.8) & (pixels[..., 2] < 0.3)
    assert orange.mean() > 0.01  # the attended tokens are highlighted


def test_speed_table_and_pareto_plot_put_quality_beside_speed(tmp_path):
    """Batched runs' speed against Full KV's at the same length, beside each arm's mean score over the tasks as a
    share of Full KV's mean over them (the suite's average: a task where Full KV scores 0 counts too)."""
    from semkv.eval import report

    def row(task, method, budget, score):
        return dict(task=task, length=1024, sample_id="s0", method=method, budget=budget, score=score)

    rows = [row("passkey", "full", None, 80.0), row("passkey", "snapkv", 0.1, 60.0), row("passkey", "quest", 0.1, 80.0),
            row("vt", "full", None, 50.0), row("vt", "snapkv", 0.1, 50.0), row("vt", "quest", 0.1, 25.0),
            row("cwe", "full", None, 0.0), row("cwe", "snapkv", 0.1, 10.0), row("cwe", "quest", 0.1, 0.0)]
    runs = [dict(task=t, length=1024, method=m, budget=b, samples=4, wall_s=w, new_tokens=400, tpot_ms=w * 10,
                 peak_memory_gib=p, attended=a)
            for t in ("passkey", "vt", "cwe")
            for m, b, w, p, a in [("full", None, 2.0, 30.0, 1000), ("snapkv", 0.1, 1.0, 10.0, 100),
                                  ("quest", 0.1, 0.5, 12.0, 100)]]
    assert report.relative_quality(rows) == pytest.approx({(1024, "full", None): 100.0,
                                                           (1024, "snapkv", 0.1): 100 * 120 / 130,
                                                           (1024, "quest", 0.1): 100 * 105 / 130})
    table = report.speed_table(rows, runs)
    assert "| 1024 | snapkv@0.1 | 400.0 | 2.00 | 10.00 | 10.0 | 100 | 92.3 |" in table
    assert "| 1024 | quest@0.1 | 800.0 | 4.00 | 5.00 | 12.0 | 100 | 80.8 |" in table
    assert table.index("| full |") < table.index("snapkv")
    assert_real_png(report._pareto_plot(1024, rows, runs, tmp_path / "pareto.png"))


def test_depth_heatmap_bands_depths_that_differ_between_lengths(results, tmp_path):
    from semkv.eval.report import _depth_bands, write_report

    grid = [{"length": n, "depth": float(d)} for n in (168, 240) for d in range(0, 101, 10)]  # 11 shared depths
    assert _depth_bands(grid) == (grid, {float(d): f"{d}%" for d in range(0, 101, 10)})
    drawn = [{"length": 168, "depth": d} for d in (0.0, 9.9, 35.5)] + [{"length": 240, "depth": d}
                                                                         for d in (10.0, 99.0, 100.0)]
    rows, labels = _depth_bands(drawn)
    assert [r["depth"] for r in rows] == [0, 0, 30, 10, 90, 90]
    assert labels == {0.0: "0-10%", 10.0: "10-20%", 30.0: "30-40%", 90.0: "90-100%"}
    # RULER's way: every sample of every length at a depth of its own -> ten rows, not one per sample
    ruler = [{**row, "depth": 2.5 * i + (1.0 if row["length"] == 240 else 0.0), "sample_id": f"{row['sample_id']}-{i}"}
             for row in ResultsDir(results).rows() for i in range(20)]
    store = ResultsDir(tmp_path)
    for row in ruler:
        store.append(row)
    write_report(tmp_path)
    rows_drawn = imread(tmp_path / "plots" / "passkey_depth_heatmap.png").shape[0]
    (tmp_path / "predictions.jsonl").write_text("".join(
        json.dumps({**row, "depth": 5.0 * (i % 20)}) + "\n" for i, row in enumerate(ruler)))  # a 20-depth grid
    write_report(tmp_path)
    assert rows_drawn < 0.7 * imread(tmp_path / "plots" / "passkey_depth_heatmap.png").shape[0]
