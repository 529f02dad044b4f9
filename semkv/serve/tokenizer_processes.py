"""Long texts tokenized in processes of their own (`semkv serve --tokenizer-processes`), so that the web process's
event loop goes on sending tokens while a long prompt is tokenized.

The web process tokenizes in worker threads, and the Rust tokenizer releases the GIL while it encodes, but building a
prompt's ids and character offsets as Python objects and converting them to arrays holds it: about 18 ms for 47k
tokens on an H200's host, during which no streamed token left the web process (results page
2026-12-02-h200-dynamic-chunking). So a text of at least `MIN_SHARED` characters goes to one of `count` processes, each
with a `TextModel` of its own; the thread that asked waits for the arrays with the GIL free, and only turns the ids
into a list (under 1 ms for 32k). The same document goes to the same process (chosen by its first `MIN_SHARED`
characters), whose `PrefixTokens` then tokenizes a follow-up question from near the document's end. A process that
died is started again, and the text it was given is tokenized in the thread (`tokens` gives None).
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from semkv.errors import SemkvError
from semkv.launch import end_with_parent
from semkv.prefix_tokens import MIN_SHARED
from semkv.text import TextModel

LOG = logging.getLogger("uvicorn.error")

_text: TextModel | None = None  # a tokenizer process's own


def _load(folder: str) -> None:
    global _text
    end_with_parent()  # also when the web process ends by a signal, which uvicorn raises again once it has drained
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which ends its processes
    _text = TextModel.load(folder)


def _tokens(text: str, special: bool) -> tuple[np.ndarray, np.ndarray | None]:
    ids, ends = _text.tokens(text, special)
    return np.asarray(ids, dtype=np.int32), ends


class TokenizerProcesses:
    """`count` tokenizer processes of the model in `folder`, started at once (`wait`: until they have loaded it);
    `tokens` is `TextModel.tokens` for texts of at least `MIN_SHARED` characters (`TextModel.long_texts`)."""

    def __init__(self, folder: str, count: int):
        self.folder = folder
        self._lock = threading.Lock()
        self.executors = [self._start() for _ in range(count)]

    def _start(self) -> ProcessPoolExecutor:
        executor = ProcessPoolExecutor(1, multiprocessing.get_context("spawn"), initializer=_load,
                                       initargs=(self.folder,))
        executor.submit(int)  # the process starts and loads the tokenizer now, not at the first long prompt
        return executor

    def wait(self) -> None:
        """Until every process has loaded the tokenizer, so that the server answers only then (a first long prompt
        had waited 12 s for its process's start on an H200's host); SemkvError if one could not load it."""
        for loaded in [executor.submit(int) for executor in self.executors]:  # runs once the tokenizer is loaded
            try:
                loaded.result()
            except BrokenProcessPool:
                raise SemkvError(f"a tokenizer process could not load the tokenizer of {self.folder} (its error is "
                                 "above); --tokenizer-processes 0 tokenizes in the web process") from None

    def tokens(self, text: str, special: bool) -> tuple[list[int], np.ndarray | None] | None:
        """`TextModel.tokens` of `text` by its process; None when that process had died (another is started, and the
        caller tokenizes this text itself)."""
        index = hash(text[:MIN_SHARED]) % len(self.executors)
        executor = self.executors[index]
        try:
            ids, ends = executor.submit(_tokens, text, special).result()
        except BrokenProcessPool:
            with self._lock:
                if self.executors[index] is executor:
                    LOG.warning("semkv serve: a tokenizer process ended; starting another")
                    self.executors[index] = self._start()
            return None
        return ids.tolist(), ends

    def close(self) -> None:
        for executor in self.executors:
            executor.shutdown(wait=False, cancel_futures=True)
