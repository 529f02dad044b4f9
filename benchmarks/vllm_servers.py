"""The servers of `vllm_serve.py`: `vllm serve` or `semkv serve` started on a free port in a process group of its own
(stopped whole, and the card's memory waited back), its /metrics read, and the model folders it serves (a random-weight
shape made once on the GPU)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_workload import CardMemory, method_entry

NAME = "qwen"  # the served model name both servers answer to


class ServerDown(Exception):
    """The server exited or did not answer /health in time."""


def metrics(url: str) -> dict[str, float]:
    """The server's Prometheus samples ({'name{labels}': value})."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                found[key] = float(value)
            except ValueError:
                pass
    return found


def kv_in_use(sample: dict[str, float]) -> dict[str, float]:
    """The KV pool in use in one /metrics sample: semkv's pages in use, vLLM's share of its blocks in use."""
    found = {}
    for key, value in sample.items():
        if key == 'semkv_kv_pool_pages{state="in_use"}':
            found["semkv_pages"] = value
        elif key.startswith("vllm:kv_cache_usage_perc"):
            found["vllm_usage"] = value
    return found


def shape_folder(shape: str, tokenizer: str) -> Path:
    """A HF folder of one of semkv bench's shapes with random weights (bf16) and `tokenizer`'s files, made once (on the
    GPU: `memory_soak.random_folder` under the device)."""
    import shutil

    import torch

    from memory_soak import random_folder

    path = Path(f"/tmp/shape-{shape}")
    if not (path / "config.json").is_file():
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            random_folder(shape, tokenizer, tmp)
        tmp.rename(path)
    return path


def kv_shape(model: str) -> dict[str, int]:
    """Bytes of one token's K and V over every layer (bf16), to turn pages and blocks into GiB."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return dict(token_bytes=config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 2)


class Server:
    def __init__(self, args, spec: str, log: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url, self.vllm = f"http://127.0.0.1:{self.port}", spec == "vllm"
        if self.vllm:
            cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--served-model-name",
                   NAME, "--port", str(self.port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--seed", "0",
                   "--gpu-memory-utilization", str(args.gpu_memory_utilization), *args.vllm_flag]
        else:
            name, params, budget, _ = method_entry(spec, args.budget)
            cmd = [sys.executable, "-m", "semkv.cli.main", "serve", "--model", args.model, "--served-model-name", NAME,
                   "--port", str(self.port), "--method", name, "--log-level", "warning"]
            cmd += ["--budget", str(budget)] if budget is not None else []
            cmd += [f"--param={k}={v}" for k, v in params.items()]
            known = subprocess.run([sys.executable, "-m", "semkv.cli.main", "serve", "--help"], capture_output=True,
                                   text=True).stdout
            for flag, value in (("--max-concurrent-requests", "1024"),
                                ("--gpu-memory-utilization", str(args.gpu_memory_utilization))):
                cmd += [flag, value] if flag in known else []
            cmd += args.semkv_flag
        self.command = cmd
        self.started = time.time()
        self.process = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, seconds: float) -> float:
        """Seconds until /health answered; ServerDown if the server exits or does not answer in time."""
        while time.time() - self.started < seconds:
            if self.process.poll() is not None:
                raise ServerDown(f"the server exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return round(time.time() - self.started, 1)
            except OSError:
                time.sleep(2)
        raise ServerDown(f"no answer on /health in {seconds:.0f} s")

    def stop(self, card: CardMemory) -> None:
        """End the server and every process it started; wait until the card's memory is back where it was."""
        for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
            try:
                os.killpg(self.process.pid, sig)
                self.process.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        end = time.time() + 60
        while card.base is not None and (card.read() or 0) > card.base + 1024 and time.time() < end:
            time.sleep(1)


def idle(server: Server, seconds: float = 30) -> dict[str, float]:
    """/metrics once no request runs any more (or after `seconds`)."""
    end = time.time() + seconds
    while True:
        sample = metrics(server.url)
        running = sum(v for k, v in sample.items()
                      if k.startswith(("vllm:num_requests_running", "semkv_requests_running")))
        if running == 0 or time.time() > end:
            return sample
        time.sleep(0.5)
