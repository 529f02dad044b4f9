"""Arguments every subcommand shares: the model flags, budgets and method parameters as the command line writes them."""
from __future__ import annotations

import argparse
import ast
import re
from typing import Any

from semkv.errors import SemkvError


def parse_budget(text: str | None) -> int | float | None:
    """'512' -> 512 tokens, '0.1' or '10%' -> fraction 0.1, None -> None."""
    if text is None:
        return None
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise SemkvError(f"budget {text!r} is not a number; give tokens (512) or a fraction (0.1 or 10%)") from None


def parse_params(items: list[str] | None, source: str = "--param") -> dict[str, Any]:
    """['window=64', 'pooling=max'] -> {'window': 64, 'pooling': 'max'}; an error names `source`, where the items
    were written."""
    params: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SemkvError(f"{source} {item!r} must look like name=value")
        try:
            params[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            params[key] = value
    return params


# HF transformers' attention for --hf (bench, eval): "sdpa", transformers' default, torch's SDPA with its own kernel
# choice (for bf16 on Hopper, torch 2.11 picks cuDNN's attention, which builds a plan for every new sequence length:
# 40-47 ms a decode step); "sdpa-flash", the same SDPA without cuDNN's kernel (flash, else memory-efficient), the
# fastest HF decode a user can pick; "eager", HF's matmuls (`semkv.bench.hf_baseline.attention_kernels`)
HF_ATTENTIONS = ("sdpa", "sdpa-flash", "eager")


def parse_names(text: str) -> list[str]:
    """'a, b[x=1,y=2]' -> ['a', 'b[x=1,y=2]']: commas inside brackets (a method variant's parameters) do not split."""
    return [name.strip() for name in re.split(r",(?![^\[]*\])", text) if name.strip()]


def split_variant(entry: str) -> tuple[str, dict[str, Any]]:
    """A `methods` entry: a method's name, or a variant of it with its own parameters, "name[param=value,...]" (as
    `--param` writes values; e.g. "chunkkv[neighbours=2]"), so that one run holds several settings of a method ->
    (the method's name, the variant's parameters)."""
    match = re.fullmatch(r"([\w-]+)(?:\[(.*)\])?", entry)
    if not match or match.group(2) == "":
        raise SemkvError(f"method {entry!r} must be a method's name or a variant such as chunkkv[neighbours=2]")
    name, inner = match.groups()
    return known_method(name), parse_params(inner.split(",") if inner else [], f"method {entry!r}:")


def known_method(name: str) -> str:
    """`name`, if it is a method of `semkv methods` (the registry imported here: these arguments load without torch)."""
    from semkv.methods import METHODS

    if name not in METHODS:
        raise SemkvError(f"unknown method {name!r}; available: {', '.join(METHODS)}")
    return name


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (1..256)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per prefill step (default: 32768 on a GPU, 512 on the CPU)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the model over N GPUs of this host (one process each)")
