"""What RULER's generators draw from: word lists, the essay haystack, and the SQuAD / HotpotQA documents.

Files (RULER's names; the shared-data names accepted too): `data_dir/wonderwords/{nounlist,adjectivelist,verblist}.txt`
(the `wonderwords` package's lists, read as lines with `rstrip()`; nounlist_v3.0.1.txt accepted), `data_dir/squad.json`
(SQuAD v2.0 dev), `data_dir/hotpotqa.json` (HotpotQA dev distractor, or its first-1000 subset
hotpotqa_dev_distractor_first1000.json) and the essay haystack `essay_file` (RULER's PaulGrahamEssays.json,
`{"text": ...}`; default `data_dir/PaulGrahamEssays.json`). Only the files a task needs are read, once.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from semkv.eval.files import data_file, read_json

# nltk.sent_tokenize stand-in: a sentence ends at . ! or ? (closing quotes/brackets allowed) before whitespace and
# an upper-case letter, digit, quote or bracket
_SENTENCE_END = re.compile(r"(?<=[.!?])([\"')\]]*)\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    return [s for s in _SENTENCE_END.sub(lambda m: m.group(1) + "\n\x00", text).split("\n\x00") if s]


@dataclass
class QASet:
    """Documents (sorted, unique) and questions, each with its gold and same-article documents (indices)."""

    docs: list[str]
    queries: list[str]
    outputs: list[list[str]]
    gold: list[list[int]]
    more: list[list[int]]
    needles: list[list[str]]  # the documents holding the answer (SQuAD: the gold one; HotpotQA: supporting facts)


@dataclass
class RulerData:
    data_dir: Path
    essay_file: Path | None = None
    words_dir: Path | None = None  # the word lists; None: data_dir/wonderwords
    _words: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def words(self, kind: str) -> list[str]:
        """'noun', 'adjective' or 'verb': the wonderwords list."""
        if kind not in self._words:
            names = [f"{kind}list.txt"] + (["nounlist_v3.0.1.txt"] if kind == "noun" else [])
            folder = self.words_dir or Path(self.data_dir) / "wonderwords"
            path = data_file(folder, names, f"RULER's {kind} list (wonderwords)")
            with open(path, encoding="utf-8") as f:
                self._words[kind] = [w for w in (line.rstrip() for line in f) if w]
        return self._words[kind]

    @cached_property
    def essay_words(self) -> list[str]:
        path = Path(self.essay_file) if self.essay_file else Path(self.data_dir) / "PaulGrahamEssays.json"
        path = data_file(path.parent, path.name, "RULER's essay haystack (PaulGrahamEssays.json)")
        return re.sub(r"\s+", " ", read_json(path)["text"]).split(" ")

    @cached_property
    def common_words(self) -> list[str]:
        """cwe's vocabulary: the distinct nouns, adjectives and verbs."""
        return sorted(set(self.words("noun") + self.words("adjective") + self.words("verb")))

    @cached_property
    def many_words(self) -> list[str]:
        """cwe's vocabulary when a sample needs more words than `common_words` holds (RULER then switches to
        english_words.json, which is not distributed): those words plus the distinct lower-case words of 3+
        letters of the essay haystack (about 21k in all)."""
        essay = {w for w in re.findall(r"[a-z]+", " ".join(self.essay_words)) if len(w) >= 3}
        return sorted(set(self.common_words) | essay)

    @cached_property
    def squad(self) -> QASet:
        data = read_json(data_file(self.data_dir, "squad.json", "RULER qa_1 (SQuAD v2.0 dev)"))["data"]
        docs = sorted({p["context"] for d in data for p in d["paragraphs"]})
        index = {doc: i for i, doc in enumerate(docs)}
        qa = QASet(docs, [], [], [], [], [])
        for article in data:
            article_docs = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = index[p["context"]]
                for q in p["qas"]:
                    if not q["is_impossible"]:
                        qa.queries.append(q["question"])
                        qa.outputs.append([a["text"] for a in q["answers"]])
                        qa.gold.append([gold])
                        qa.more.append([i for i in article_docs if i != gold])
                        qa.needles.append([p["context"]])
        return qa

    @cached_property
    def hotpotqa(self) -> QASet:
        path = data_file(self.data_dir, ["hotpotqa.json", "hotpotqa_dev_distractor_first1000.json"],
                         "RULER qa_2 (HotpotQA dev distractor)")
        data = read_json(path)

        def doc(title, sentences):
            return f"{title}\n{''.join(sentences)}"

        docs = sorted({doc(t, s) for d in data for t, s in d["context"]})
        index = {d: i for i, d in enumerate(docs)}
        qa = QASet(docs, [], [], [], [], [])
        for d in data:
            supporting = {title for title, _ in d["supporting_facts"]}
            qa.queries.append(d["question"])
            qa.outputs.append([d["answer"]])
            qa.gold.append([index[doc(t, s)] for t, s in d["context"]])
            qa.more.append([])
            qa.needles.append([doc(t, s) for t, s in d["context"] if t in supporting])
        return qa
