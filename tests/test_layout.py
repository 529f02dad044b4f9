"""The layout rules: the engine imports nothing from the methods, no module imports one that imports it back (imports
inside functions included), and a new method needs one file and one registry line."""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import semkv
from semkv.engine.hooks import DecodeBatch, KVMethod, Selection, resolve_budget
from semkv.methods import METHODS

PACKAGE = Path(semkv.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """Module -> the semkv modules it imports anywhere in its file (a package stands for its __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("semkv",) + path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("semkv"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("semkv")}
        # a module's own packages are loading already when it runs: importing them is no edge
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def test_the_engine_imports_nothing_from_the_methods():
    graph = import_graph()
    assert {(a, b) for a, deps in graph.items() for b in deps
            if a.startswith("semkv.engine") and b.startswith("semkv.methods")} == set()


def test_no_import_circles():
    graph = import_graph()

    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    assert sorted(m for m in graph if m in reaches(m)) == []


@dataclass
class RecentOnly(KVMethod):
    """A newcomer's method: attend to the newest `budget` tokens (a selection from the batch tensors alone, so it is
    graph-safe). One class, one registry line."""

    name = "recent_only"
    summary = "the newest budget tokens"
    kind = "selection"
    graph_safe = True

    def select(self, layer: int, batch: DecodeBatch, q: torch.Tensor) -> Selection | None:
        if self.budget is None:
            return None
        n = batch.num_slots[:, layer]  # [B]
        width = min(resolve_budget(self.budget, batch.max_slots), batch.max_slots)
        first = (n - width).clamp(min=0)  # [B]
        slots = first[:, None] + torch.arange(width, device=n.device)  # [B, width] ascending
        lengths = torch.minimum(n, torch.full_like(n, width))
        return Selection(slots[:, None], lengths[:, None])


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(METHODS, RecentOnly.name, RecentOnly)


def test_a_new_method_is_one_class_and_one_registry_line(registered, tiny_model_dir):
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    prompts = ["The passkey is 4821. Remember it. " + "Grass is green. " * 6, "Pages hold keys and values. " * 5]
    run = dict(max_new_tokens=8, chat=False, ignore_eos=True)
    full = [o.token_ids for o in llm.generate(prompts, method="full", **run)]
    assert [o.token_ids for o in llm.generate(prompts, method="recent_only", budget=10_000, **run)] == full
    outs = llm.generate(prompts, method="recent_only", budget=16, **run)
    assert max(o.stats.kv_attended_max for o in outs) == 16
