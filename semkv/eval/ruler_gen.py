"""RULER's generators, written from the spec in shared/data/ruler/SOURCE.md (NVIDIA/RULER @ c3f5e3b,
`scripts/data/synthetic/`): each turns (data, random generator, haystack size) into the parts of one prompt.

The random draws that do not depend on the size (keys, values, chains, vocabularies) come first, so every size tried
while fitting the length shows the same needles. Each sample has its own `random.Random`; where RULER shuffles with
a fresh `Random(seed)` (the same permutation for every sample of a size), the sample's generator shuffles here.
"""
from __future__ import annotations

import math
import random
import string
import uuid
from dataclasses import dataclass, field

import numpy as np

from semkv.eval.ruler_data import QASet, RulerData, split_sentences

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
ZETA_2 = math.pi ** 2 / 6
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]


@dataclass
class Parts:
    context: str
    question: str
    answer_prefix: str
    answers: list[str]
    needles: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NiahSpec:
    haystack: str  # "noise", "essay" or "needle"
    key_type: str  # "words", "numbers" or "uuids"
    value_type: str
    k: int = 1  # keys
    v: int = 1  # values per key
    q: int = 1  # queried keys


def draw(kind: str, data: RulerData, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(1000000, 9999999))
    if kind == "words":  # uniform over adjective-noun pairs, as RULER's random.choice over their sorted product
        return f"{rng.choice(data.words('adjective'))}-{rng.choice(data.words('noun'))}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def niah(spec: NiahSpec, data: RulerData, rng: random.Random, size: int) -> Parts:
    k = max(spec.k, spec.q)
    keys = [draw(spec.key_type, data, rng) for _ in range(k)]
    values = [[draw(spec.value_type, data, rng) for _ in range(spec.v)] for _ in keys]
    needles = [NEEDLE.format(type_v=spec.value_type, key=key, value=v) for key, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    queried = rng.sample(range(k), spec.q)
    if spec.haystack == "essay":
        words = data.essay_words
        text = " ".join((words * (size // len(words) + 1))[:size])
        sents = split_sentences(text.strip())
        cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
        pieces = []
        for i in range(1, len(cuts)):
            pieces.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
            if i - 1 < len(needles):
                pieces.append(needles[i - 1])
        haystack = " ".join(pieces)
    else:
        if spec.haystack == "noise":
            lines = [NOISE] * size
        else:  # distractor needles with random keys and values
            lines = [NEEDLE.format(type_v=spec.value_type, key=draw(spec.key_type, data, rng),
                                   value=draw(spec.value_type, data, rng)) for _ in range(size)]
        for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            lines.insert(index, needle)
        haystack = "\n".join(lines)
    query_keys = [keys[i] for i in queried]
    query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1] if len(query_keys) > 1 else query_keys[0]
    intro = "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will " \
            "quiz you about the {type_v} afterwards."
    question = "What are all the special magic {type_v} for {query} mentioned in the provided text?"
    prefix = " The special magic {type_v} for {query} mentioned in the provided text are"
    type_v = spec.value_type
    if spec.q * spec.v == 1:  # RULER's singular wording
        intro, question, prefix = (t.replace("Some", "A").replace("are all", "is").replace("are", "is")
                                   .replace("answers", "answer") for t in (intro, question, prefix))
        type_v = type_v[:-1]
    answer_needles = [NEEDLE.format(type_v=spec.value_type, key=keys[i], value=v) for i in queried for v in values[i]]
    return Parts(f"{intro.format(type_v=type_v)}\n{haystack}", question.format(type_v=type_v, query=query),
                 prefix.format(type_v=type_v, query=query), [v for i in queried for v in values[i]], answer_needles)


VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = "Question: Find all variables that are assigned the value {value} in the text above."
VT_PREFIX = " Answer: According to the chain(s) of variable assignment in the text above, {n} variables are " \
            "assigned the value {value}, they are: "


def vt_names(rng: random.Random, count: int, letters: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def vt_haystack(rng: random.Random, names: list[str], value: int | str, size: int) -> str:
    """The chain `VAR A = value`, `VAR B = VAR A `... at sorted random positions among `size` noise lines."""
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])]
    lines = [NOISE] * size
    for j, pos in enumerate(sorted(rng.sample(range(size), len(chain)))):
        lines.insert(pos + j, chain[j])
    return "\n".join(lines).replace(". \n", ".\n")


def vt(example: str, rng: random.Random, size: int, hops: int = 4) -> Parts:
    """`example`: the few-shot example with {n0}.. name and {value} fields (`vt_example`), filled anew per sample."""
    names, value = vt_names(rng, hops + 1, 5), rng.randint(10000, 99998)
    shot = dict(zip([f"n{j}" for j in range(hops + 1)], vt_names(rng, hops + 1, 3)), value=rng.randint(10000, 99998))
    chain = vt_haystack(rng, names, value, size)
    chain_lines = [line for line in chain.split("\n") if line.startswith("VAR ")]
    return Parts(f"{example.format(**shot)}{VT_INTRO}\n\n{chain}", VT_QUESTION.format(value=value),
                 VT_PREFIX.format(n=hops + 1, value=value), names, chain_lines)


def vt_example(rng: random.Random, size: int, hops: int = 4) -> str:
    """RULER's in-context example (3-letter names, value 12345, the prompt followed by its answer) with the names and
    the value left as fields: RULER replaces them per sample."""
    names = [f"{{n{j}}}" for j in range(hops + 1)]
    prompt = f"{VT_INTRO}\n\n{vt_haystack(rng, names, '{value}', size)}\n{VT_QUESTION}" \
             f"{VT_PREFIX.format(n=hops + 1, value='{value}')}"
    return f"{prompt} {' '.join(names)}\n"


CWE_INTRO = "Below is a numbered list of words. In these words, some appear more often than others. Memorize the " \
            "ones that appear most often."
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"


def numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def cwe_list(pool: list[str], rng: random.Random, n_words: int, repeats: tuple[int, int]) -> tuple[str, list[str]]:
    chosen = rng.sample(pool, n_words)
    common = chosen[:10]
    items = common * repeats[0] + chosen[10:] * repeats[1]
    rng.shuffle(items)
    return numbered(items), common


def cwe(data: RulerData, rng: random.Random, size: int, short: bool) -> Parts:
    """`short`: RULER's setting below 4096 tokens (example 20 words repeated 3/1, sample repeats 6/1)."""
    shot, shot_answer = cwe_list(data.common_words, rng, 20 if short else 40, (3, 1) if short else (10, 3))
    example = f"{CWE_INTRO}\n{shot}\n{CWE_QUESTION}{CWE_PREFIX} {numbered(shot_answer)}\n"
    pool = data.common_words if size <= len(data.common_words) else data.many_words
    words, common = cwe_list(pool, rng, size, (6, 1) if short else (30, 3))
    return Parts(f"{example}{CWE_INTRO}\n{words}", CWE_QUESTION, CWE_PREFIX, common)


def fwe(rng: random.Random, size: int, vocab_size: int) -> Parts:
    """Zipf-distributed (alpha 2) 6-letter coded words: rank k appears int(size * k^-2 / zeta(2)) times; the most
    frequent is the noise '...', the answers are ranks 2-4."""
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    bag = [w for k, w in enumerate(ranked, 1) for _ in range(int(size * k ** -2.0 / ZETA_2))]
    rng.shuffle(bag)
    intro = "Read the following coded text and track the frequency of each coded word. Find the three most " \
            "frequently appeared coded words. "
    question = "Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most " \
               "frequently appeared words in the above coded text?"
    return Parts(intro + " ".join(bag), question,
                 " Answer: According to the coded text above, the three most frequently appeared words are:",
                 ranked[1:4])


QA_INSTRUCTION = "Answer the question based on the given documents. Only give me the answer and do not output any " \
                 "other words."


def qa(qas: QASet, index: int, rng: random.Random, size: int) -> Parts:
    """The question's gold documents plus distractors (same-article ones first, then random others) filling `size`
    words; the last distractor is cut to fit (RULER stops at whole documents)."""
    gold, more = qas.gold[index], qas.more[index]
    taken = set(gold) | set(more)
    stream = rng.sample(more, len(more)) + rng.sample([i for i in range(len(qas.docs)) if i not in taken],
                                                      len(qas.docs) - len(taken))
    docs, budget, j = [qas.docs[i] for i in gold], size, 0
    while budget > 0:  # cycles through the documents if needed, as RULER repeats them
        words = qas.docs[stream[j % len(stream)]].split(" ")
        docs.append(" ".join(words[:budget]))
        budget, j = budget - len(words), j + 1
    rng.shuffle(docs)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
    return Parts(f"{QA_INSTRUCTION}\n\nThe following are given documents.\n\n{context}",
                 f"{QA_INSTRUCTION}\n\nQuestion: {qas.queries[index]}", " Answer:", qas.outputs[index],
                 qas.needles[index])
