"""The task registry: `TASKS[name](data_dir, **params)` builds a task; `GROUPS` names families of tasks.

`data_dir` is the root of a folder laid out like the project's shared data (tasks that generate everything ignore
it; without it, RULER and NIAH read the data of installed packages, `packaged.py`): `paul_graham/gkamradt_essays/*.txt`
(niah), `paul_graham/ruler_PaulGrahamEssays.json` and `ruler/` with squad.json, hotpotqa.json (or its first-1000
subset) and wonderwords/ (ruler_*), `longbench/data/<dataset>.jsonl` (longbench_<dataset>, the official data.zip
unzipped) and `longbench/v2/data.json` (longbench_v2), `books/` (long texts for perplexity, `perplexity_data`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from semkv.errors import SemkvError
from semkv.eval import packaged, synthetic
from semkv.eval.longbench import V1_PROMPTS, LongBenchV1, LongBenchV2
from semkv.eval.niah import NeedleInAHaystack
from semkv.eval.ruler import RULER_TASKS, ruler_task
from semkv.eval.task import Task


def _root(data_dir: str | Path | None, name: str) -> Path:
    if data_dir is None:
        raise SemkvError(f"task {name!r} reads data files: give data_dir (--data-dir), the folder that holds "
                         "paul_graham/, ruler/ and longbench/")
    return Path(data_dir)


def _ruler(task: str) -> Callable[..., Task]:
    def make(data_dir=None, chat: bool = True) -> Task:
        if data_dir is None:
            folder = packaged.ruler_json()
            return ruler_task(task, folder, folder / "PaulGrahamEssays.json", chat, packaged.word_lists())
        root = Path(data_dir)
        return ruler_task(task, root / "ruler", root / "paul_graham" / "ruler_PaulGrahamEssays.json", chat)
    return make


def _longbench(dataset: str) -> Callable[..., Task]:
    return lambda data_dir=None: LongBenchV1(dataset, _root(data_dir, f"longbench_{dataset}") / "longbench" / "data")


TASKS: dict[str, Callable[..., Task]] = {
    "passkey": lambda data_dir=None, chat=True: synthetic.passkey(chat),
    "number_string": lambda data_dir=None, chat=True: synthetic.number_string(chat),
    "kv_retrieval": lambda data_dir=None, chat=True: synthetic.kv_retrieval(chat),
    "niah": lambda data_dir=None: NeedleInAHaystack(
        None if data_dir is None else Path(data_dir) / "paul_graham" / "gkamradt_essays"),
    **{f"ruler_{task}": _ruler(task) for task in RULER_TASKS},
    **{f"longbench_{dataset}": _longbench(dataset) for dataset in V1_PROMPTS},
    "longbench_v2": lambda data_dir=None: LongBenchV2(_root(data_dir, "longbench_v2") / "longbench" / "v2"),
}
GROUPS: dict[str, list[str]] = {
    "infinitebench": ["passkey", "number_string", "kv_retrieval"],
    "ruler": [f"ruler_{task}" for task in RULER_TASKS],
    "longbench": [f"longbench_{dataset}" for dataset in V1_PROMPTS],
}


def task_names(names: str | list[str]) -> list[str]:
    """Task and group names (a list or comma-separated) -> task names, groups expanded, order kept."""
    names = names.split(",") if isinstance(names, str) else names
    out: list[str] = []
    for name in (n.strip() for n in names if n.strip()):
        if name not in TASKS and name not in GROUPS:
            raise SemkvError(f"unknown task {name!r}; known: {', '.join([*GROUPS, *TASKS])}")
        out += [n for n in GROUPS.get(name, [name]) if n not in out]
    return out


def get_task(name: str, data_dir: str | Path | None = None, **params: Any) -> Task:
    task_names(name)
    return TASKS[name](data_dir, **params)
