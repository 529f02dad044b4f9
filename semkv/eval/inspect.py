"""`semkv inspect`: the selection diagnostics of one method on one prompt, per layer and KV head.

The prompt runs under Full KV and the method with one shared prefill (`LLM.compare`), tracing the first `steps`
decode steps (Full KV with its attention probabilities); `diagnostics.head_maps` turns the traces into per (layer,
KV head) needle retention (when a needle is given), top-k recall and mass recall. Written: a PNG heat map per measure
(layers x KV heads) and the HTML view of the evaluation reports for the two runs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from semkv.eval import diagnostics, html
from semkv.eval.task import Sample
from semkv.methods import KVMethod, get_method

TITLES = {"retention": "needle retained", "recall": "top-k recall", "mass_recall": "attention-mass recall"}


def inspect(llm: Any, method: KVMethod, prompt: str, question: str | None = None, needle: str | None = None,
            answer: str | None = None, steps: int = 8, chat: bool = True, name: str = "prompt",
            max_new_tokens: int = 32) -> dict[str, Any]:
    """Run Full KV and `method` on the prompt (answers of up to `max_new_tokens`, the first `steps` decode steps
    traced); return the per (layer, KV head) maps, the overall numbers (`diag`), both outputs and the HTML view."""
    full, out = llm.compare(prompt, [get_method("full"), method], question, max(steps, max_new_tokens), chat,
                            trace_steps=range(steps), trace_weights=True)
    requirements = diagnostics.prompt_requirements(llm, prompt, question, chat, "", [needle] if needle else [],
                                                   [answer] if answer else [])
    n_prompt = len(out.prompt_token_ids)
    maps = diagnostics.head_maps(out, full, method.budget, requirements, n_prompt)
    sample = Sample("inspect", name, prompt, question or "", [answer] if answer else [], n_prompt,
                    needles=[needle] if needle else [])
    view = html.sample_view(llm.tokenizer, sample, out.prompt_token_ids, llm.config.num_kv_heads)
    for label, budget, result in (("full", None, full), (f"{method.name}@{method.budget}", method.budget, out)):
        row = {"method": label.split("@")[0], "budget": budget, "prediction": result.text, "score": None}
        view["methods"][label] = html.method_view(result.trace, n_prompt, row)
    return {"maps": maps, "diag": diagnostics.summarize(maps), "full": full, "output": out, "view": view}


def layer_table(maps: dict[str, torch.Tensor]) -> str:
    """One line per layer: each measure's mean over KV heads."""
    names = list(maps)
    lines = ["layer  " + "  ".join(f"{TITLES[n]:>22}" for n in names)]
    layers = next(iter(maps.values())).shape[0] if maps else 0
    for layer in range(layers):
        lines.append(f"{layer:5d}  " + "  ".join(f"{float(maps[n][layer].mean()):22.3f}" for n in names))
    lines.append("  all  " + "  ".join(f"{float(maps[n].mean()):22.3f}" for n in names))
    return "\n".join(lines)


def heatmap(maps: dict[str, torch.Tensor], title: str, path: str | Path) -> Path:
    """A PNG with one layers x KV heads panel per measure (0..1)."""
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(2.4 * len(maps) + 1.2, 6.0), layout="constrained")
    axes = fig.subplots(1, len(maps), squeeze=False)[0]
    for ax, (name, values) in zip(axes, maps.items()):
        image = ax.imshow(values.numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto", interpolation="nearest")
        ax.set_title(f"{TITLES[name]}\nmean {float(values.mean()):.2f}", fontsize=9)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(values.shape[1]))
    fig.colorbar(image, ax=list(axes), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path
