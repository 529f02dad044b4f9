"""Vocabulary scans shared by methods that reason about token text (SentenceKV's sentence ends, DynSplit-KV's
delimiter candidates): the decoded text of every token id, and bool masks of the ids whose text satisfies a
predicate. Both are computed once per tokenizer object and cached (byte-level BPE merges punctuation with spaces and
newlines, so a fixed list of strings misses most such tokens; scanning the vocabulary finds them all)."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

_TEXTS: "weakref.WeakKeyDictionary[Any, list[str]]" = weakref.WeakKeyDictionary()
_MASKS: "weakref.WeakKeyDictionary[Any, dict[Callable[[str], bool], torch.Tensor]]" = weakref.WeakKeyDictionary()


def token_texts(tokenizer: Any) -> list[str]:
    """Decoded text of every token id, 0..len(tokenizer)-1 (special tokens as their text, spaces kept)."""
    texts = _TEXTS.get(tokenizer)
    if texts is None:
        ids = list(range(len(tokenizer)))
        texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        pieces = tokenizer.convert_ids_to_tokens(ids)
        # SentencePiece marks a leading space with "▁", which decoding a lone token drops
        texts = [" " + t if isinstance(p, str) and p.startswith("▁") and not t.startswith(" ") else t
                 for t, p in zip(texts, pieces)]
        _TEXTS[tokenizer] = texts
    return texts


def vocab_mask(tokenizer: Any, predicate: Callable[[str], bool]) -> torch.Tensor:
    """Bool [len(tokenizer)]: which token ids' text satisfies `predicate` (cached per tokenizer and predicate, so
    pass a module-level function, not a fresh lambda)."""
    masks = _MASKS.setdefault(tokenizer, {})
    if predicate not in masks:
        masks[predicate] = torch.tensor([bool(predicate(t)) for t in token_texts(tokenizer)], dtype=torch.bool)
    return masks[predicate]


def lookup(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """mask[ids], False for ids past the tokenizer's vocabulary (models may pad their embedding table)."""
    inside = ids < mask.shape[0]
    return mask[ids.clamp(max=mask.shape[0] - 1)] & inside
