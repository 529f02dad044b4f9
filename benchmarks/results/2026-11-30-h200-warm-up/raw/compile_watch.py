"""Run a script, logging every Triton compile (a JIT cache miss) with its wall time and duration, to stderr."""
import runpy, sys, time
from triton import knobs

T0 = time.perf_counter()
start = {}


def before(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **kw):
    start[id(fn), str(key)] = time.perf_counter()
    return None


def after(*, key, repr, fn, compile, is_manual_warmup, already_compiled, **kw):
    t = time.perf_counter()
    s = start.pop((id(fn), str(key)), t)
    print(f"COMPILE t={t - T0:8.2f} dur={(t - s) * 1000:7.1f}ms {repr.split('[')[0]} {str(key)[:1500]}", file=sys.stderr, flush=True)
    return None


knobs.runtime.jit_cache_hook = before
knobs.runtime.jit_post_compile_hook = after
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print(f"END t={time.perf_counter() - T0:8.2f}", file=sys.stderr, flush=True)
