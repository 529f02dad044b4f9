"""The decode rows a `semkv bench` run printed, as its results.json would hold them (bench185 and bench_own stopped at
a method's CUDA out-of-memory error before writing results.json; `semkv bench` now skips such a method and writes the
rest). Usage: python log_rows.py LOG OUT_DIR BUDGET"""
import json
import re
import sys
from pathlib import Path

LINE = re.compile(r"^(\w+)\s+B=(\d+)\s+ctx=(\d+)\s+TPOT\s+([\d.]+) ms \(mean ([\d.]+), forward ([\d.]+)\)\s+([\d.]+) "
                  r"tok/s\s+selection (?:([\d.]+)%|-)\s+peak\s+([\d.]+) GiB\s+attended\s+(\d+)")
log, out, budget = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
rows = []
for line in log.read_text().splitlines():
    m = LINE.match(line)
    if m:
        name = m[1]
        rows.append(dict(method=name, budget=None if name == "full" else budget, batch=int(m[2]), context=int(m[3]),
                         tpot_ms=float(m[4]), tpot_mean_ms=float(m[5]), forward_ms=float(m[6]),
                         tokens_per_s=float(m[7]), peak_memory_gib=float(m[9]), attended_per_layer=float(m[10])))
out.mkdir(parents=True, exist_ok=True)
(out / "results.json").write_text(json.dumps(dict(info=dict(source=str(log)), decode=rows, hf=[]), indent=1))
print(f"{len(rows)} rows -> {out / 'results.json'}")
