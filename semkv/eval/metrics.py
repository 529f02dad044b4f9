"""Scorers of the synthetic tasks, each a function (prediction, references) -> 0..100, as the benchmarks define them.

RULER (`scripts/eval/synthetic/constants.py`): the prediction is post-processed (strip, control characters to
newlines, strip), then `string_match_all` is the fraction of references contained in it and `string_match_part` is 1
if any is, case-insensitive. InfiniteBench (`src/compute_scores.py`): passkey and number_string compare the label with
the first run of digits in the prediction; kv_retrieval checks whether the label is one of the prediction's words
after replacing `\\n : " ' . , ? ! { }` with spaces. Benchmark-level numbers are means over samples, rounded to 2.
"""
from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")
_KV_SEPARATORS = ("\n", ":", '"', "'", ".", ",", "?", "!", "{", "}")


def ruler_postprocess(prediction: str) -> str:
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    pred = ruler_postprocess(prediction).lower()
    return 100.0 * sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    pred = ruler_postprocess(prediction).lower()
    return 100.0 * max(ref.lower() in pred for ref in references)


def first_digits(prediction: str) -> str:
    """The first non-empty run of digits (InfiniteBench's `first_int_match`), '' if none."""
    return next((piece for piece in re.split("[^0-9]", prediction) if piece), "")


def digits_match(prediction: str, references: list[str]) -> float:
    """InfiniteBench passkey / number_string accuracy."""
    return 100.0 * (first_digits(prediction) == references[0])


def kv_match(prediction: str, references: list[str]) -> float:
    """InfiniteBench kv_retrieval accuracy: the label is one of the prediction's words."""
    for sep in _KV_SEPARATORS:
        prediction = prediction.replace(sep, " ")
    return 100.0 * (references[0] in prediction.split())


def mean_score(scores: list[float]) -> float:
    """A benchmark's number: the mean of per-sample scores (0..100), rounded to 2 decimals as the papers report."""
    return round(sum(scores) / len(scores), 2)
