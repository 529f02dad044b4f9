"""LongBench's official metrics, reimplemented so that re-scoring reproduces the published numbers exactly.

Source of the definitions: THUDM/LongBench `LongBench/metrics.py` and `eval.py` (v1), `pred.py` (v2), with the
packages their results were computed with: `rouge` 1.0.1 (ROUGE-L F, summary level: the text is split into sentences
at "."; the score counts the *distinct* words of the union LCS; its recursive LCS walk raises RecursionError on paths
of 991+ steps, which LongBench's bare `except` turns into 0, reproduced here), fuzzywuzzy 0.18 without
python-Levenshtein (`fuzz.ratio` = difflib's SequenceMatcher ratio, rounded) and jieba 0.42 for Chinese tokens
(an optional dependency: `pip install jieba`). Per-sample scores are 0..1 as in LongBench; the task number is
`round(100 * total / n, 2)` with the total summed in file order.
"""
from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable

import numpy as np

from semkv.errors import SemkvError

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_EN_PUNCT = frozenset(string.punctuation)
_ZH_PUNCT = _EN_PUNCT | frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
# rouge 1.0.1's `_recon` recursion fails at this many steps under CPython's default limit of 1000, counting the
# frames of LongBench's eval.py above it (one more, rouge_zh_score, for the Chinese tasks)
_RECURSION_STEPS_EN, _RECURSION_STEPS_ZH = 991, 990
FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def _cut(text: str) -> list[str]:
    try:
        import jieba
    except ImportError:
        raise SemkvError("LongBench's Chinese metrics need jieba: pip install jieba") from None
    jieba.setLogLevel(60)
    return list(jieba.cut(text, cut_all=False))


def _normalize_en(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _normalize_zh(text: str) -> str:
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCT).split())


def _f1(pred: list[str], truth: list[str]) -> float:
    same = sum((Counter(pred) & Counter(truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(truth)
    return (2 * precision * recall) / (precision + recall)


def qa_f1(pred: str, truth: str, all_classes=None) -> float:
    return _f1(_normalize_en(pred).split(), _normalize_en(truth).split())


def qa_f1_zh(pred: str, truth: str, all_classes=None) -> float:
    def tokens(text):
        return [t for t in (_normalize_zh(w) for w in _cut(text)) if t]

    return _f1(tokens(pred), tokens(truth))


class _TooDeep(Exception):
    """rouge 1.0.1 would have hit the recursion limit."""


def _lcs_union(ref: list[list[str]], hyp: list[list[str]], max_steps: int) -> set[str]:
    """Distinct words of the LCSs of every (reference sentence, hypothesis sentence) pair, each walked back as rouge's
    `_recon_lcs` does. One DP per reference sentence covers all hypothesis sentences laid side by side, each after a
    sentinel column, with per-sentence offsets so that the running max restarts at every sentence."""
    ids: dict[str, int] = {}
    cols, starts = [], []
    for words in hyp:
        starts.append(len(cols))
        cols += [-1] + [ids.setdefault(w, len(ids)) for w in words]
    ys = np.array(cols)  # [cols] word ids, -1 at the sentinels
    offset = np.cumsum(ys == -1) * (len(cols) + 1)  # [cols]
    union: set[str] = set()
    for x in ref:
        table = np.zeros((len(x) + 1, len(cols)), dtype=np.int64)  # [len(x)+1, cols] LCS lengths of prefixes
        for i, w in enumerate(x, 1):
            prev = table[i - 1]
            # a match extends the diagonal, else take the cell above; the running max adds the cell to the left
            cand = np.where(ys == ids.setdefault(w, len(ids)), np.concatenate(([0], prev[:-1] + 1)), prev)
            table[i] = np.maximum.accumulate(cand + offset) - offset
        rows = table.tolist()
        for start, y in zip(starts, hyp):
            i, j, steps = len(x), len(y), 0
            if rows[i][start + j] == 0:  # nothing in common: the walk goes straight left, len(y) steps
                if j >= max_steps:
                    raise _TooDeep
                continue
            while i > 0 and j > 0:
                steps += 1
                if steps >= max_steps:
                    raise _TooDeep
                if x[i - 1] == y[j - 1]:
                    union.add(x[i - 1])
                    i, j = i - 1, j - 1
                elif rows[i - 1][start + j] > rows[i][start + j - 1]:
                    i -= 1
                else:
                    j -= 1
    return union


def _rouge_l(pred: str, truth: str, max_steps: int) -> float:
    hyp = [" ".join(s.split()).split(" ") for s in pred.split(".") if len(s) > 0]
    ref = [" ".join(s.split()).split(" ") for s in truth.split(".") if len(s) > 0]
    if not hyp or not ref:
        return 0.0  # rouge raises "Hypothesis is empty", LongBench returns 0
    try:
        union = _lcs_union(ref, hyp, max_steps)
    except _TooDeep:
        return 0.0
    recall = len(union) / len({w for s in ref for w in s})
    precision = len(union) / len({w for s in hyp for w in s})
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def rouge_l(pred: str, truth: str, all_classes=None) -> float:
    return _rouge_l(pred, truth, _RECURSION_STEPS_EN)


def rouge_l_zh(pred: str, truth: str, all_classes=None) -> float:
    return _rouge_l(" ".join(_cut(pred)), " ".join(_cut(truth)), _RECURSION_STEPS_ZH)


def classification(pred: str, truth: str, all_classes: list[str]) -> float:
    matches = [c for c in all_classes if c in pred]
    i = 0  # LongBench removes from the list it iterates over, which skips the element after each removal
    while i < len(matches):
        term = matches[i]
        if term in truth and term != truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if truth in matches else 0.0


def _share_of_numbers(pred: str, target: str) -> float:
    numbers = re.findall(r"\d+", pred)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def count(pred: str, truth: str, all_classes=None) -> float:
    return _share_of_numbers(pred, str(truth))


def retrieval(pred: str, truth: str, all_classes=None) -> float:
    return _share_of_numbers(pred, re.findall(r"Paragraph (\d+)", truth)[0])


def retrieval_zh(pred: str, truth: str, all_classes=None) -> float:
    return _share_of_numbers(pred, re.findall(r"段落(\d+)", truth)[0])


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18 `fuzz.ratio` with difflib: 100 if equal, 0 if either is empty."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim(pred: str, truth: str, all_classes=None) -> float:
    """Edit similarity of the first line without a backtick, '#' or '//' (LongBench skips comment lines)."""
    lines = pred.lstrip("\n").split("\n")
    line = next((s for s in lines if "`" not in s and "#" not in s and "//" not in s), "")
    return fuzz_ratio(line, truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    **dict.fromkeys(["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"], qa_f1),
    "multifieldqa_zh": qa_f1_zh,
    **dict.fromkeys(["gov_report", "qmsum", "multi_news", "samsum"], rouge_l),
    **dict.fromkeys(["dureader", "vcsum"], rouge_l_zh),
    **dict.fromkeys(["trec", "lsht"], classification),
    "passage_retrieval_en": retrieval,
    "passage_retrieval_zh": retrieval_zh,
    "passage_count": count,
    **dict.fromkeys(["lcc", "repobench-p"], code_sim),
}


def score_v1(dataset: str, prediction: str, answers: list[str], all_classes: list[str] | None) -> float:
    """One LongBench v1 sample, 0..1: the best score over the gold answers."""
    if dataset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = METRICS[dataset]
    best = 0.0
    for truth in answers:
        best = max(best, metric(prediction, truth, all_classes=all_classes))
    return best


def task_score_v1(scores: list[float]) -> float:
    """LongBench's task number from per-sample 0..1 scores: round(100 * total / n, 2), summed in order."""
    total = 0.0
    for s in scores:
        total += s
    return round(100 * total / len(scores), 2)


def extract_choice(response: str) -> str | None:
    """LongBench v2's answer extraction: 'The correct answer is (X)' or 'The correct answer is X', '*' removed."""
    response = response.replace("*", "")
    match = re.search(r"The correct answer is \(([A-D])\)", response) or re.search(
        r"The correct answer is ([A-D])", response)
    return match.group(1) if match else None
