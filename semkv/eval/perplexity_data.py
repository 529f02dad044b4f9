"""Long texts for perplexity: Project Gutenberg books (PG-19 style), header and license footer stripped at load time.

The stored files keep Project Gutenberg's header and license (the license asks for it); `book_text` returns what lies
between the `*** START OF ...` and `*** END OF ...` lines, without the "End of [the] Project Gutenberg..." line
before the end marker and the volunteers' "Produced by ..." credits paragraph, with the byte-order mark removed and CRLF
turned into LF.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from semkv.errors import SemkvError
from semkv.eval.files import data_file

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE | re.IGNORECASE)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG EBOOK.*$", re.MULTILINE | re.IGNORECASE)
_END_LINE = re.compile(r"^End of (the )?Project Gutenberg.*$", re.MULTILINE | re.IGNORECASE)


def books(data_dir: str | Path) -> list[str]:
    """Names (file stems) of the books in `data_dir`, sorted."""
    names = sorted(p.stem for p in Path(data_dir).glob("*.txt"))
    if not names:
        raise SemkvError(f"perplexity books: expected Project Gutenberg .txt files in {Path(data_dir).resolve()}, "
                         "none found")
    return names


def book_text(data_dir: str | Path, book: str) -> str:
    path = data_file(data_dir, f"{book}.txt", f"perplexity book {book!r}")
    text = path.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
    start, end = _START.search(text), _END.search(text)
    if start is None or end is None:
        raise SemkvError(f"{path} has no Project Gutenberg '*** START OF' / '*** END OF' lines to strip")
    body = text[start.end():end.start()]
    footer = list(_END_LINE.finditer(body))
    if footer:
        body = body[:footer[-1].start()]
    body = body.strip()
    if body.lower().startswith("produced by"):
        body = body.split("\n\n", 1)[-1].lstrip()
    return body + "\n"


def book_token_ids(tokenizer: Any, data_dir: str | Path, book: str, n_tokens: int) -> list[int]:
    """The first `n_tokens` token ids of the book's text (no special tokens); an error if the book is shorter."""
    ids = tokenizer(book_text(data_dir, book), add_special_tokens=False)["input_ids"]
    if len(ids) < n_tokens:
        raise SemkvError(f"book {book!r} has {len(ids)} tokens, fewer than the {n_tokens} asked for")
    return ids[:n_tokens]
