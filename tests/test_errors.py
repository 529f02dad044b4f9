"""Bad input: one clear message naming the bad value and what is allowed; exit code 2 from the CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import semkv
from semkv.cli.main import main


def run_cli(*args: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "semkv.cli.main", *args], capture_output=True, text=True)
    return proc.returncode, proc.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt", "hi", "--method", "nope"], "unknown method 'nope'; available: full"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "0"], "budget=0 must be a positive number"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "-5"], "budget=-5 must be a positive number"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "1.5"], r"budget=1.5 as a fraction must be in \(0, 1\]"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "lots"], "budget 'lots' is not a number"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "8", "--param", "window=-1"], "window=-1 is out of range"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "8", "--param", "nope=1"], "unknown parameter"),
        (["--prompt", "hi", "--method", "snapkv"], "method 'snapkv' needs a budget"),
        (["--prompt", "hi", "--device", "tpu"], "unknown device 'tpu'"),
        (["--prompt", "hi", "--model", "/no/such/model"], "model path '/no/such/model' does not exist"),
        (["--prompt-file", "/no/such/file.txt"], "--prompt-file '/no/such/file.txt' does not exist"),
        # checked before the model loads: the model path given is never reached
        (["--prompt", "  ", "--model", "/no/such/model"], "--prompt is empty; give some text"),
        (["--prompt", "hi", "--max-new-tokens", "0", "--model", "/no/such/model"],
         r"--max-new-tokens=0 must be an int >= 1"),
        (["--prompt", "hi", "--temperature", "-1", "--model", "/no/such/model"],
         r"--temperature=-1.0 must be >= 0 \(0 = greedy\)"),
        (["--prompt", "hi", "--top-p", "0", "--model", "/no/such/model"], r"--top-p=0.0 must be in \(0, 1\]"),
        (["--prompt", "hi", "--method", "nope", "--model", "/no/such/model"], "unknown method 'nope'"),
        # non-finite numbers, integers out of range and text that is not Unicode, also before the model loads
        (["--prompt", "hi", "--temperature", "nan", "--model", "/no/such/model"],
         r"--temperature=nan must be >= 0 \(0 = greedy\) and finite"),
        (["--prompt", "hi", "--temperature", "inf", "--model", "/no/such/model"], "--temperature=inf must be"),
        (["--prompt", "hi", "--top-p", "nan", "--model", "/no/such/model"], r"--top-p=nan must be in \(0, 1\]"),
        (["--prompt", "hi", "--seed", str(2**80), "--model", "/no/such/model"],
         r"--seed=1208925819614629174706176 must be an int in \[-2\*\*63, 2\*\*64 - 1\]"),
        (["--prompt", "hi", "--max-new-tokens", str(2**40), "--model", "/no/such/model"],
         "--max-new-tokens=1099511627776 must be an int >= 1 and <= 2147483647"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "nan", "--model", "/no/such/model"],
         "budget 'nan' is not a number"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "1e999", "--model", "/no/such/model"],
         r"budget=inf as a fraction must be in \(0, 1\]"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", str(2**40), "--model", "/no/such/model"],
         "budget=1099511627776 must be a positive number of tokens"),
        (["--prompt", "hi", "--method", "h2o", "--budget", "8", "--param", "recent_ratio=1e999", "--model",
          "/no/such/model"], "recent_ratio=inf must be a finite number"),
        (["--prompt", "hi", "--method", "snapkv", "--budget", "8", "--param", "window=2**80"],
         "window='2\\*\\*80' must be of type int"),
        (["--prompt", "hi", "--method", "snapkv", "--param", "budget=8", "--param", f"window={2**80}", "--model",
          "/no/such/model"], r"window=1208925819614629174706176 is out of range; allowed: \[0, 2147483647\]"),
        (["--prompt", "bad \udcff", "--model", "/no/such/model"], r"--prompt holds '\\udcff' at character 4"),
        (["--prompt", "hi", "--stop", "\ud800", "--model", "/no/such/model"], r"--stop holds '\\ud800'"),
    ],
)
def test_cli_bad_input(args, message, capsys):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("semkv: error: ")
    assert __import__("re").search(message, err), err
    assert "Traceback" not in err


def test_help_does_not_load_torch():
    """`semkv --help` and every subcommand's parser are built without importing torch, transformers or the methods
    (they load with the subcommand that runs)."""
    code = ("import sys; from semkv.cli.main import build_parser; build_parser(); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'matplotlib'}), "
            "sorted(m for m in sys.modules if m.startswith('semkv.methods')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] []"
    for command in ([], ["generate"], ["eval"], ["bench"], ["inspect"], ["report"], ["calibrate"], ["methods"],
                    ["serve"]):
        proc = subprocess.run([sys.executable, "-m", "semkv.cli.main", *command, "--help"], capture_output=True,
                              text=True)
        assert proc.returncode == 0 and "usage: semkv" in proc.stdout


def test_serve_checks_its_flags_before_the_model_loads():
    for flags, needle in [(["--method", "nope"], "unknown method 'nope'"), (["--port", "70000"], "--port 70000"),
                          (["--method", "snapkv", "--budget", "-1"], "budget"),
                          (["--max-concurrent-requests", "0"], "--max-concurrent-requests 0"),
                          (["--timeout-keep-alive", "nan"], "--timeout-keep-alive=nan must be a finite number"),
                          (["--param", "window=1e999", "--method", "snapkv", "--budget", "8"], "window=inf")]:
        code, err = run_cli("serve", *flags)
        assert code == 2 and err.startswith("semkv: error:") and needle in err, err


def test_cli_exit_code_in_a_subprocess():
    code, err = run_cli("generate", "--prompt", "hi", "--method", "nope")
    assert code == 2 and "Traceback" not in err and "unknown method" in err


def test_empty_prompt(tiny_llm):
    with pytest.raises(semkv.SemkvError, match="the prompt is empty"):
        tiny_llm.generate("   ")
    with pytest.raises(semkv.SemkvError, match="prompt 1 is empty"):
        tiny_llm.generate(["hello", ""])
    with pytest.raises(semkv.SemkvError, match="no prompts"):
        tiny_llm.generate([])


def test_prompt_longer_than_context(tiny_llm):
    limit = tiny_llm.max_context
    text = "word " * (limit + 10)
    with pytest.raises(semkv.SemkvError, match=rf"the prompt has \d+ tokens .* > the model's context of {limit}"):
        tiny_llm.generate(text, chat=False, max_new_tokens=2)


def test_overlong_prompt_can_be_allowed(tiny_model_dir):
    llm = semkv.LLM(tiny_model_dir("llama"), device="cpu")
    llm.config.max_position_embeddings = 64
    out = llm.generate("word " * 70, chat=False, max_new_tokens=2, allow_overlong=True, ignore_eos=True)
    assert len(out[0].token_ids) == 2


@pytest.mark.parametrize("kw, message", [
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(stop=[""]), "stop="),
])
def test_bad_sampling_parameters(tiny_llm, kw, message):
    with pytest.raises(semkv.SemkvError, match=message):
        tiny_llm.generate("hello", **kw)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kw, message", [
    (dict(temperature=NAN), r"temperature=nan must be >= 0 \(0 = greedy\) and finite"),
    (dict(temperature=INF), r"temperature=inf must be >= 0 \(0 = greedy\) and finite"),
    (dict(temperature=True), "temperature=True must be"),
    (dict(top_p=NAN), r"top_p=nan must be in \(0, 1\]"),
    (dict(seed=2**80), r"seed=1208925819614629174706176 must be an int in \[-2\*\*63, 2\*\*64 - 1\]"),
    (dict(seed=1.5), "seed=1.5 must be an int"),
    (dict(max_new_tokens=2**80), "max_new_tokens=1208925819614629174706176 must be an int >= 1 and <= 2147483647"),
    (dict(max_new_tokens=True), "max_new_tokens=True must be an int"),
    (dict(top_k=2**40), "top_k=1099511627776 must be an int >= 0"),
    (dict(top_k=-1), "top_k=-1 must be an int >= 0"),
    (dict(logprobs=True), "logprobs=True must be an int in 0..20"),
    (dict(ignore_eos="yes"), "ignore_eos='yes' must be True or False"),
    (dict(method="snapkv", budget=NAN), r"budget=nan as a fraction must be in \(0, 1\]"),
    (dict(method="snapkv", budget=INF), r"budget=inf as a fraction must be in \(0, 1\]"),
    (dict(method="snapkv", budget=2**80), "budget=1208925819614629174706176 must be a positive number of tokens "
                                          r"\(at most 2147483647\)"),
    (dict(method="snapkv", budget=True), "budget=True must be an int"),
    (dict(method="h2o", budget=8, method_params=dict(recent_ratio=NAN)), "recent_ratio=nan must be a finite number"),
    (dict(method="sentencekv", budget=8, method_params=dict(keep_factor=INF)), "keep_factor=inf must be a finite"),
    (dict(method="snapkv", budget=8, method_params=dict(window=2**80)),
     r"window=1208925819614629174706176 is out of range; allowed: \[0, 2147483647\]"),
    (dict(method="snapkv", budget=8, method_params=dict(window=True)), "window=True must be of type int"),
    (dict(method="snapkv", budget=8, method_params=dict(budget=5)), r"the budget is given twice \(8 and the "),
    (dict(stop=["\udcff"]), r"a stop string holds '\\udcff' at character 0, a lone UTF-16 surrogate"),
    (dict(stop=[3]), r"stop=\[3\] must be a list of non-empty strings"),
    (dict(prompts="hello \udcff"), r"the prompt holds '\\udcff' at character 6, a lone UTF-16 surrogate that is not "
                                    "Unicode text; send valid UTF-8"),
    (dict(prompts=["fine", 7]), r"prompt 1 must be text \(str\), not int: 7"),
    (dict(questions=["what \ud800?"]), r"the question holds '\\ud800' at character 5"),
    (dict(answer_prefixes=[b"bytes"]), r"the answer prefix must be text \(str\), not bytes"),
])
def test_non_finite_out_of_range_and_non_text_values_are_named(tiny_llm, kw, message):
    """What a user may pass by mistake, or a client on purpose (issue 52: NaN temperature, seed 2**80 and a lone
    surrogate got past the checks): one SemkvError naming the value and what is allowed, before the engine runs."""
    prompts = kw.pop("prompts", "hello")
    with pytest.raises(semkv.SemkvError, match=message):
        tiny_llm.generate(prompts, max_new_tokens=kw.pop("max_new_tokens", 2), chat=False, **kw)
    assert tiny_llm.engine.memory().held == (0, 0, 0, 0)


def test_other_entry_points_check_text_and_token_ids(tiny_llm):
    with pytest.raises(semkv.SemkvError, match=r"the prompt holds '\\udcff'"):
        tiny_llm.compare("a \udcff", [semkv.get_method("snapkv", 8)], max_new_tokens=2)
    with pytest.raises(semkv.SemkvError, match=r"the continuation holds '\\ud800'"):
        tiny_llm.score_continuation("Hello there", "\ud800")
    with pytest.raises(semkv.SemkvError, match=r"list of token ids in \[0, "):
        tiny_llm.compare([1, True, 3], [semkv.get_method("snapkv", 8)], max_new_tokens=2)
    with pytest.raises(semkv.SemkvError, match=r"message 0's content holds '\\udfff'"):
        tiny_llm.encode_chat([{"role": "user", "content": "\udfff"}])
    assert tiny_llm.engine.memory().held == (0, 0, 0, 0)


def test_a_tiny_temperature_samples_the_greedy_token(tiny_llm):
    """A temperature of 1e-300 divides the logits past float32's range (it gave NaN probabilities before): sampling
    in float64 from the shifted logits gives the most likely token."""
    kw = dict(max_new_tokens=6, chat=False, ignore_eos=True)
    greedy = tiny_llm.generate("The capital of France is", **kw)[0].token_ids
    for temperature in (1e-300, 5e-324):
        assert tiny_llm.generate("The capital of France is", temperature=temperature, seed=1, **kw)[0].token_ids == \
            greedy


def test_corrupted_weight_files(tmp_path, tiny_model_dir):
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(semkv.SemkvError, match="corrupted weight file"):
        semkv.LLM(folder, device="cpu")
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(semkv.SemkvError, match="could not read the GGUF file .* truncated or corrupt"):
        semkv.LLM(gguf, device="cpu")
    gguf.write_bytes(b"<html>not a model</html>")
    with pytest.raises(semkv.SemkvError, match="it is not a GGUF file"):
        semkv.LLM(gguf, device="cpu")


def test_gguf_without_the_gguf_package_says_what_to_install(tmp_path, monkeypatch):
    """transformers raises ImportError when the gguf package is missing (as on a fresh GPU machine): the error names
    the package, not a damaged file."""
    import transformers

    def missing(*args, **kwargs):
        raise ImportError("Loading a GGUF checkpoint in PyTorch, requires both PyTorch and GGUF>=0.10.0 to be "
                          "installed")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", missing)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(semkv.SemkvError, match=r"needs the gguf package .*pip install 'gguf>=0.10'"):
        semkv.LLM(gguf, device="cpu")


@pytest.mark.slow
def test_truncated_gguf_says_so(tmp_path):
    """Half of the embedded GGUF (a download cut short): the error says the file is truncated, not how numpy failed
    to reshape its data."""
    from semkv.models.loader import embedded_model_path

    data = embedded_model_path().read_bytes()
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(semkv.SemkvError, match=r"truncated or corrupt \(49,\d{3},\d{3} bytes; ValueError"):
        semkv.LLM(half, device="cpu")


def test_bad_page_size(tiny_model_dir):
    with pytest.raises(semkv.SemkvError, match="page_size=0 is out of range; allowed: 1..256"):
        semkv.LLM(tiny_model_dir("llama"), device="cpu", page_size=0)


@pytest.mark.parametrize("variable, kind, allowed", [("SEMKV_PREFILL_ATTENTION", "prefill", "auto, fa3, cudnn, triton"),
                                                     ("SEMKV_DECODE_ATTENTION", "decode", "auto, fa3, triton")])
def test_bad_attention_path_is_named(tiny_model_dir, monkeypatch, variable, kind, allowed):
    monkeypatch.setenv(variable, "flash")
    with pytest.raises(semkv.SemkvError, match=f"{variable}='flash' is not a {kind} attention; allowed: {allowed}"):
        semkv.LLM(tiny_model_dir("llama"), device="cpu")
    proc = subprocess.run([sys.executable, "-m", "semkv.cli.main", "generate", "--prompt", "hi", "--device", "cpu"],
                          capture_output=True, text=True, env={**__import__("os").environ})
    assert proc.returncode == 2 and f"{variable}='flash'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_gpu_memory_utilization(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(semkv.SemkvError, match=r"gpu_memory_utilization=1.5 is out of range; allowed: \[0.05, 1.0\]"):
        semkv.LLM(tiny_model_dir("llama"), device="cpu", gpu_memory_utilization=1.5)
    assert main(["eval", "--device", "cpu", "--task", "passkey", "--methods", "full", "--lengths", "192",
                 "--gpu-memory-utilization", "0", "--out", str(tmp_path / "e")]) == 2
    assert "gpu_memory_utilization=0.0 is out of range" in capsys.readouterr().err


def test_methods_lists_every_method_with_its_parameters(capsys):
    """`semkv methods --json` names every registered method with its kind and each parameter's default; the text
    form prints one line per method."""
    from semkv.methods import METHODS

    assert main(["methods", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert set(listed) == set(METHODS)
    for name, cls in METHODS.items():
        assert listed[name]["kind"] == cls.kind
        assert set(listed[name]["parameters"]) == set(cls.parameters())
    assert listed["snapkv"]["parameters"]["window"] == 32
    assert main(["methods"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[::2]] == list(METHODS)


def test_infllm_block_size_must_fit_the_pages(tiny_llm):
    """InfLLM stores a block key at the page of the block's first slot."""
    with pytest.raises(semkv.SemkvError, match="block_size=24 must divide or be a multiple of the KV page size 16"):
        tiny_llm.generate("Hello there.", method="infllm", budget=8, method_params=dict(block_size=24),
                          max_new_tokens=2)
