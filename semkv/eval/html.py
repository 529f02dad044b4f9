"""The HTML view of one sample: the prompt, token by token, once per method, each token shaded by how many KV heads
attended to it at the first decode step (the answer step) and greyed where eviction dropped it; a selector shows one
layer or all layers together. The data comes from the engine's trace (`semkv/engine/trace.py`), saved by the runner
for the first samples of each task and length (`--trace-samples`).
"""
from __future__ import annotations

import html
import itertools
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from semkv.engine.trace import Trace
from semkv.errors import SemkvError
from semkv.eval.task import Sample


def sample_view(tokenizer: Any, sample: Sample, prompt_ids: list[int], kv_heads: int) -> dict[str, Any]:
    """What the page shows of a sample, before any method: its prompt tokens as text pieces."""
    return {"task": sample.task, "sample_id": sample.sample_id, "length": sample.length, "depth": sample.depth,
            "question": sample.question, "answers": sample.answers, "needles": sample.needles, "kv_heads": kv_heads,
            "tokens": [tokenizer.decode([t]) for t in prompt_ids], "methods": {}}


def _counts(per_layer: list[list[torch.Tensor]], n: int) -> list[list[int]]:
    """[layer][kv_head] -> positions, to [layer] -> how many heads hold each prompt position [n]."""
    out = []
    for heads in per_layer:
        positions = torch.cat(heads)
        out.append(torch.bincount(positions[positions < n], minlength=n).tolist())
    return out


def method_view(trace: Trace, n_prompt: int, row: dict[str, Any]) -> dict[str, Any]:
    """One method's part of the page: its result row and per-layer counts of heads that kept / attended each token."""
    attended = trace.attended.get(0)
    return {"method": row["method"], "budget": row["budget"], "prediction": row["prediction"], "score": row["score"],
            "resident": _counts(trace.resident, n_prompt),
            "attended": None if attended is None else _counts(attended, n_prompt)}


def _needle_mask(tokens: list[str], needles: list[str]) -> list[bool]:
    text = "".join(tokens)
    starts = [0]
    for piece in tokens:
        starts.append(starts[-1] + len(piece))
    mask = [False] * len(tokens)
    for needle in needles:
        at = text.find(needle)
        while needle and at >= 0:
            for i in range(len(tokens)):
                mask[i] = mask[i] or (starts[i] < at + len(needle) and starts[i + 1] > at)
            at = text.find(needle, at + 1)
    return mask


CSS = """body{font:13px/1.35 system-ui,sans-serif;margin:16px;color:#222}h1{font-size:18px;margin:0 0 6px}
.meta{color:#555;margin-bottom:10px}.legend span{padding:0 4px;margin-right:8px}
section{border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:8px}section h2{font-size:14px;margin:0 0 4px}
.info{color:#444;font-size:12px;margin-bottom:4px}.text{white-space:pre-wrap;font:11px/1.5 monospace;max-height:330px;
overflow-y:auto;border-top:1px solid #eee;padding-top:4px}.n{border-bottom:2px solid #d00}"""

# The page's data holds the prompt's tokens once and, per method, each layer's head counts per token as a line of
# text (`_layer_line`), each distinct line once; the script writes every method's tokens and shades them.
SCRIPT = """const D=JSON.parse(document.getElementById('data').textContent),N=D.tokens.length,H=D.kv_heads;
function line(s){const a=new Array(N);if(s[0]!=='!'){for(let i=0;i<N;i++)a[i]=s.charCodeAt(i)-48;return a;}
 let i=0;for(const p of s.slice(1).split(',')){const k=+p.slice(1);a.fill(p.charCodeAt(0)-48,i,i+k);i+=k;}return a;}
function layers(m,key){m.lines=m.lines||[];
 return m[key]===null?null:m[key].map(j=>m.lines[j]||(m.lines[j]=line(m.rows[j])));}
function paint(sel){const sec=sel.closest('section'),m=D.methods[sec.dataset.m],L=+sel.value;
 const att=layers(m,'attended'),res=layers(m,'resident'),nl=m.layers,spans=sec.querySelectorAll('.text span');
 for(let i=0;i<spans.length;i++){let a=0,r=0;
  if(L<0){for(let l=0;l<nl;l++){a+=att?att[l][i]:0;r+=res?res[l][i]:H;}a/=nl*H;r/=nl*H;}
  else{a=att?att[L][i]/H:0;r=(res?res[L][i]:H)/H;}
  spans[i].style.background='rgba(255,140,0,'+a.toFixed(2)+')';spans[i].style.color=r>0?'#000':'#aaa';}}
const needle=new Set(D.needle);
for(const sec of document.querySelectorAll('section')){const box=sec.querySelector('.text');
 D.tokens.forEach((t,i)=>{const s=document.createElement('span');s.textContent=t;if(needle.has(i))s.className='n';
  box.appendChild(s);});paint(sec.querySelector('select'));}"""


def _layer_line(counts: list[int]) -> str:
    """One layer's head counts per token as text: a character per token (chr(48 + count)), or, where shorter, its runs
    '!<char><length>,<char><length>...' ('!' is below every count's character; the script's `line` reads both)."""
    raw = "".join(chr(48 + c) for c in counts)
    runs = "!" + ",".join(f"{char}{len(list(group))}" for char, group in itertools.groupby(raw))
    return runs if len(runs) < len(raw) else raw


def _method_data(m: dict[str, Any], heads: int) -> dict[str, Any]:
    """A method's counts for the page: its distinct layer lines (`rows`) and, per layer, which line holds its attended
    and its resident counts (resident None: every head keeps every token; attended None: no decode step)."""
    rows: list[str] = []
    index: dict[str, int] = {}

    def lines(per_layer: list[list[int]]) -> list[int]:
        out = []
        for counts in per_layer:
            text = _layer_line(counts)
            out.append(index.setdefault(text, len(rows)))
            if out[-1] == len(rows):
                rows.append(text)
        return out

    kept_all = all(c == heads for counts in m["resident"] for c in counts)
    return {"layers": len(m["resident"]), "rows": rows,
            "resident": None if kept_all else lines(m["resident"]),
            "attended": None if m["attended"] is None else lines(m["attended"])}


def _section(label: str, m: dict[str, Any], n_tokens: int, needle: list[bool], heads: int) -> str:
    layers = len(m["resident"])
    total = layers * heads
    attended = [sum(col) / total for col in zip(*m["attended"])] if m["attended"] else [0.0] * n_tokens
    needles = [a for a, is_needle in zip(attended, needle) if is_needle]
    shown = "no decode step (the answer ended after its first token): kept tokens only" if not m["attended"] else (
        f"attended per head and layer: {sum(attended):.0f} of {n_tokens} prompt tokens")
    if needles:
        shown += f" · needle tokens attended: {100 * sum(needles) / len(needles):.0f}%"
    options = '<option value="-1">all layers</option>' + "".join(
        f'<option value="{layer}">layer {layer}</option>' for layer in range(layers))
    prediction = "(perplexity)" if m["prediction"] is None else html.escape(repr(m["prediction"]))
    score = "" if m["score"] is None else f' — score {m["score"]:.4g}'
    return (f'<section data-m="{html.escape(label)}"><h2>{html.escape(label)}{score}</h2>'
            f'<div class="info">prediction: {prediction} · {shown} · <select onchange="paint(this)">{options}'
            f'</select></div><div class="text"></div></section>')


def render(view: dict[str, Any]) -> str:
    """The page of one traced sample (a dict from `sample_view` with its `methods` filled)."""
    tokens, heads = view["tokens"], view["kv_heads"]
    needle = _needle_mask(tokens, view["needles"])
    ordered = sorted(view["methods"].items(), key=lambda kv: (kv[1]["method"] != "full", kv[1]["method"],
                                                            isinstance(kv[1]["budget"], float), kv[1]["budget"] or 0))
    sections = "".join(_section(label, m, len(tokens), needle, heads) for label, m in ordered)
    data = json.dumps({"kv_heads": heads, "tokens": tokens, "needle": [i for i, n in enumerate(needle) if n],
                       "methods": {k: _method_data(m, heads) for k, m in view["methods"].items()}},
                      separators=(",", ":")).replace("<", "\\u003c")  # no "</script>" inside the script element
    title = f"{view['task']} · {view['sample_id']}"
    depth = "" if view["depth"] is None else f" · needle depth {view['depth']:.0f}%"
    return (f"<!doctype html><html><head><meta charset=utf-8><title>{html.escape(title)}</title><style>{CSS}</style>"
            f"</head><body><h1>{html.escape(title)}</h1><div class=meta>{len(tokens)} prompt tokens"
            f"{depth} · question: "
            f"{html.escape(view['question'] or '-')} · gold: {html.escape(', '.join(view['answers'])[:200])}</div>"
            '<div class="legend"><span style="background:rgba(255,140,0,.9)">attended by every head</span>'
            '<span style="background:rgba(255,140,0,.3)">by some heads</span><span style="color:#aaa">evicted</span>'
            '<span class=n>needle</span> (at the first decode step; "all layers" averages over layers)</div>'
            f'{sections}<script id="data" type="application/json">{data}</script><script>{SCRIPT}</script>'
            "</body></html>")


def write(view: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(view), encoding="utf-8")
    return path


def screenshot(html_path: str | Path, png_path: str | Path, width: int = 1200, height: int = 1600) -> Path:
    """Render a page with headless Chromium (Debian's `chromium` package) to a PNG."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SemkvError("chromium is not installed (Debian: apt-get install chromium); it renders the PNG")
    png_path = Path(png_path).resolve()
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={profile}", f"--screenshot={png_path}", f"--window-size={width},{height}",
                        Path(html_path).resolve().as_uri()], check=True, capture_output=True, timeout=180)
    if not png_path.is_file():
        raise SemkvError(f"chromium did not write {png_path}")
    return png_path
