"""The profiled steps of a reduced trace (kernels, copies and memsets; the runtime's and the driver's launches; the
step ranges of first_steps.py --profile): per step the tokens' kind, host time, device span and busy time (the union
of the kernels its host range launched), and the device's idle gaps over 100 us by the pair of operations around
them. The traces were reduced from torch.profiler's Chrome traces to those events (the full ones are 3 MB each).

    python gaps.py call2_trace_old.json.gz
"""
import collections
import gzip
import json
import sys


def union(spans):
    busy, reach = 0.0, None
    for a, b in sorted(spans):
        if reach is None or a > reach:
            busy, reach = busy + b - a, b
        elif b > reach:
            busy, reach = busy + b - reach, b
    return busy


events = json.load(gzip.open(sys.argv[1], "rt"))
steps = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e["cat"] == "user_annotation")
launch = {e["correlation"]: e["ts"] for e in events if e["cat"] in ("cuda_runtime", "cuda_driver")}
kernels = sorted((e for e in events if e["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
mine = collections.defaultdict(list)
for k in kernels:
    at = launch.get(k["correlation"])
    for start, end, name in steps:
        if at is not None and start <= at <= end:
            mine[name].append(k)
            break
total_busy = total_span = 0.0
for start, end, name in steps:
    spans = [(k["ts"], k["ts"] + k["dur"]) for k in mine[name]]
    span, busy = spans[-1][1] - spans[0][0], union(spans)
    total_busy, total_span = total_busy + busy, total_span + span
    print(f"{name}: host {(end - start) / 1e3:.1f} ms, device span {span / 1e3:.1f}, busy {busy / 1e3:.1f}, "
          f"{len(spans)} kernels")
window = [k for name in mine for k in mine[name]]
spans = [(k["ts"], k["ts"] + k["dur"]) for k in window]
print(f"all {len(steps)} steps: device span {(max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3:.1f} ms, "
      f"busy {union(spans) / 1e3:.1f} ms (mean a step {union(spans) / 1e3 / len(steps):.1f})")
gaps, counts = collections.Counter(), collections.Counter()
window.sort(key=lambda k: k["ts"])
reach = window[0]["ts"] + window[0]["dur"]
for a, b in zip(window, window[1:]):
    gap, reach = b["ts"] - reach, max(reach, b["ts"] + b["dur"])
    if gap > 100:
        key = f"{a['name'][:32]} -> {b['name'][:32]}"
        gaps[key] += gap
        counts[key] += 1
print("idle gaps over 100 us, by the operations before and after:")
for key, gap in gaps.most_common(10):
    print(f"  {gap / 1e3:7.2f} ms in {counts[key]:4d}: {key}")
