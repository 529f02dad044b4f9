"""KV-selection methods: a module for a method that fits one file, a package (method, state, references, kernels) for
one that does not, and the registry used by the API, the CLI and the shared tests. A new method is a `KVMethod`
subclass (`semkv.engine.hooks`) and one entry in `SPECS` (`specs.py`: its name, class, kind, summary, paper and
parameter defaults as plain data, checked against the class by a test).

`SPECS` loads without torch; `METHODS` (name -> class), the classes and `get_method` load on first use, so that
`semkv methods` and `--help` start at once."""
from __future__ import annotations

import importlib
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from semkv.errors import SemkvError
from semkv.methods.specs import SPECS, MethodSpec

if TYPE_CHECKING:
    from semkv.engine.hooks import KVMethod

# public names that load on first use -> their module (a method class: the module its spec names)
_LAZY = {"KVMethod": "semkv.engine.hooks", "DecodeBatch": "semkv.engine.hooks", "Selection": "semkv.engine.hooks"}
_LAZY |= {spec.cls.split(":")[1]: spec.cls.split(":")[0] for spec in SPECS.values()}

__all__ = [
    "METHODS", "SPECS", "Chess", "ChunkKV", "DecodeBatch", "DynSplitKV", "FullKV", "H2O", "InfLLM", "KVMethod",
    "KeyDiff", "MethodSpec", "PyramidKV", "Quest", "Selection", "SentenceKV", "SnapKV", "StreamingLLM",
    "TokenSelect", "get_method",
]


def _methods() -> dict[str, type[KVMethod]]:
    """`METHODS`, name -> class in the order of SPECS: imported once, one dict for the process (a test may register a
    method into it)."""
    if "METHODS" not in globals():
        globals()["METHODS"] = {key: getattr(importlib.import_module(spec.cls.split(":")[0]), spec.cls.split(":")[1])
                                for key, spec in SPECS.items()}
    return globals()["METHODS"]


def __getattr__(name: str) -> Any:
    if name == "METHODS":
        return _methods()
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'semkv.methods' has no attribute {name!r}")


def get_method(method: str | KVMethod, budget: int | float | None = None, /, **params: Any) -> KVMethod:
    """A method object from a name, or a given object (a copy with `budget` filled in if it had none; the object
    itself is never changed). Old parameter names (`KVMethod.renamed`) are accepted with a DeprecationWarning."""
    from semkv.engine.hooks import KVMethod

    methods = _methods()
    if isinstance(method, KVMethod):
        if params:
            raise SemkvError(f"method parameters {sorted(params)} go into the method object, not generate()")
        if budget is not None and method.budget is None:
            return replace(method, budget=budget)
        return method
    if not isinstance(method, str) or method not in methods:
        raise SemkvError(f"unknown method {method!r}; available: {', '.join(methods)}")
    cls = methods[method]
    if "budget" in params:  # a caller's dict of parameters (kv_params, --param) may hold it
        if budget is not None:
            raise SemkvError(f"the budget is given twice ({budget!r} and the parameter budget={params['budget']!r}); "
                             "give one")
        budget = params.pop("budget")
    for old in set(params) & set(cls.renamed):
        new = cls.renamed[old]
        warnings.warn(f"{method} parameter {old!r} is now {new!r}", DeprecationWarning, stacklevel=2)
        params[new] = params.pop(old)
    allowed = cls.parameters()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise SemkvError(
            f"unknown parameter(s) {', '.join(unknown)} for method {method!r}; "
            f"allowed: {', '.join(k for k in allowed if k != 'budget') or 'none'}"
        )
    if budget is None and cls.kind != "full":
        raise SemkvError(f"method {method!r} needs a budget: an int (tokens) or a float in (0, 1]")
    return cls(budget=budget, **params)
