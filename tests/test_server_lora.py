"""Multi-LoRA through `pagedserve serve --enable-lora --lora-modules`: a request whose `model` names
an adapter gets the offline engine's greedy tokens under the same `LoRARequest`; /v1/models lists
the adapters; unknown names, adapters on embeddings, bad flags and bad adapter folders are refused
with errors that name the problem.

One server (a tiny random Llama with SmolLM2's tokenizer, two adapters taking one slot in turn)
serves the module; an offline `LLM` with the same engine options gives the expected tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from lora_support import write_adapter
from server_support import ServerProcess, build_tiny_model, start_server
from transformers import LlamaForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.cli.main import main as cli_main
from pagedserve.lora.request import LoRARequest

MODEL = "tiny"
MAX_TOKENS = 8
PROMPT = [5, 6, 7, 8, 9, 10]
ENGINE = ["--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64", "--block-size", "16"]
LORA = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    adapters: dict[str, Path]  # name -> PEFT folder, in --lora-modules order (lora_int_id 1, 2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    hf_model = LlamaForCausalLM.from_pretrained(model_dir)
    root = tmp_path_factory.mktemp("adapters")
    # Large deltas (scaling 2 and 4 over weights of std 0.5): greedy tokens change for sure.
    sql = write_adapter(
        root / "sql", hf_model, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=1, scale=0.5
    )
    chat = write_adapter(
        root / "chat",
        hf_model,
        rank=8,
        alpha=32,
        targets=["k_proj", "o_proj", "gate_proj", "up_proj"],
        seed=2,
        scale=0.5,
        rslora=True,
    )
    return Setup(model_dir, {"sql": sql, "chat": chat})


@pytest.fixture(scope="module")
def server(setup: Setup) -> Iterator[ServerProcess]:
    chat_entry = json.dumps({"name": "chat", "path": str(setup.adapters["chat"]), "base_model_name": "llama"})
    proc = start_server(
        setup.model_dir,
        *ENGINE,
        *LORA,
        "--lora-modules",
        f"sql={setup.adapters['sql']}",
        chat_entry,
        name=MODEL,
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def llm(setup: Setup) -> LLM:
    """The offline engine with the server's engine options."""
    return LLM(
        str(setup.model_dir),
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=64,
        block_size=16,
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
    )


def _lora(setup: Setup, model: str) -> LoRARequest | None:
    """The LoRARequest the server builds for `model` (ids 1..n in flag order); None: the base."""
    if model == MODEL:
        return None
    return LoRARequest(model, list(setup.adapters).index(model) + 1, str(setup.adapters[model]))


def _offline_text(llm: LLM, setup: Setup, prompt: list[int], model: str) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate(
        {"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=_lora(setup, model)
    )
    return out.outputs[0].text


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def _completion(model: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    return body | {"ignore_eos": True} | extra


def test_models_lists_the_base_model_then_each_adapter(server: ServerProcess, setup: Setup) -> None:
    r = httpx.get(f"{server.base_url}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [m["id"] for m in data] == [MODEL, "sql", "chat"]
    assert data[0]["root"] == str(setup.model_dir) and data[0]["parent"] is None
    assert data[1]["root"] == str(setup.adapters["sql"]) and data[1]["parent"] == MODEL
    # vLLM's JSON form: its base_model_name is the parent shown.
    assert data[2]["root"] == str(setup.adapters["chat"]) and data[2]["parent"] == "llama"
    one = httpx.get(f"{server.base_url}/v1/models/sql", timeout=30)
    assert one.status_code == 200 and one.json() == data[1]


@pytest.mark.parametrize("model", [MODEL, "sql", "chat"])
def test_completion_runs_the_named_adapter(server: ServerProcess, setup: Setup, llm: LLM, model: str) -> None:
    r = _post(server, "/v1/completions", _completion(model))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    text = r.json()["choices"][0]["text"]
    assert text == _offline_text(llm, setup, PROMPT, model)
    if model != MODEL:
        assert text != _offline_text(llm, setup, PROMPT, MODEL)  # the adapter changed the tokens


def test_streamed_completion_and_n_samples_run_the_adapter(
    server: ServerProcess, setup: Setup, llm: LLM
) -> None:
    expected = _offline_text(llm, setup, PROMPT, "chat")
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=_completion("chat", stream=True), timeout=120
    ) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["model"] for c in chunks} == {"chat"}
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    r = _post(server, "/v1/completions", _completion("chat", n=2))
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [expected, expected]  # greedy samples agree


def test_beam_search_runs_the_adapter(server: ServerProcess, setup: Setup, llm: LLM) -> None:
    """A beam of width 1 keeps the most likely token each step: the adapter's greedy tokens."""
    r = _post(server, "/v1/completions", _completion("sql", use_beam_search=True))
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert r.json()["choices"][0]["text"] == _offline_text(llm, setup, PROMPT, "sql")


def test_chat_runs_the_named_adapter(server: ServerProcess, setup: Setup, llm: LLM) -> None:
    tokenized = _post(server, "/tokenize", {"model": "sql", "messages": MESSAGES})
    assert tokenized.status_code == 200, tokenized.text
    expected = _offline_text(llm, setup, tokenized.json()["tokens"], "sql")
    body = {
        "model": "sql",
        "messages": MESSAGES,
        "max_completion_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sql"
    assert r.json()["choices"][0]["message"]["content"] == expected
    with httpx.stream(
        "POST", f"{server.base_url}/v1/chat/completions", json=body | {"stream": True}, timeout=120
    ) as streamed:
        events = [line.removeprefix("data: ") for line in streamed.iter_lines() if line.startswith("data: ")]
    deltas = [json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1]]
    assert "".join(deltas) == expected


def test_concurrent_requests_of_every_model_share_the_server(
    server: ServerProcess, setup: Setup, llm: LLM
) -> None:
    """Requests of both adapters and the base model at once: with --max-loras 1 the adapters take
    the slot in turn, and each request still gets its own model's tokens."""
    models = [MODEL, "sql", "chat", "sql", MODEL, "chat"]

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=_completion(m)) for m in models)
            )
        return [r.json()["choices"][0]["text"] for r in responses]

    expected = {m: _offline_text(llm, setup, PROMPT, m) for m in set(models)}
    assert asyncio.run(run()) == [expected[m] for m in models]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}),
        ("/tokenize", {"prompt": "hi"}),
    ],
)
def test_an_unknown_model_is_404(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    r = _post(server, path, {"model": "nope", **body})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["type"] == "not_found_error" and error["param"] == "model"
    assert "'nope' does not exist" in error["message"] and "'sql'" in error["message"]
    assert httpx.get(f"{server.base_url}/v1/models/nope", timeout=30).status_code == 404


def test_embeddings_naming_an_adapter_are_refused(server: ServerProcess) -> None:
    r = _post(server, "/v1/embeddings", {"model": "sql", "input": "hello"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "model" and "LoRA adapter" in error["message"]
    assert _post(server, "/v1/embeddings", {"model": MODEL, "input": "hello"}).status_code == 200


def test_a_bad_adapter_fails_start_up_naming_it(setup: Setup, tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    cmd = [
        sys.executable,
        "-m",
        "pagedserve.cli.main",
        "serve",
        str(setup.model_dir),
        "--port",
        "0",
        *ENGINE,
        *LORA,
        "--lora-modules",
        f"sql={setup.adapters['sql']}",
        f"broken={missing}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert result.returncode == 1, result.stderr
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert last.startswith(f"pagedserve serve: --lora-modules broken={missing}: "), last
    assert "no adapter_config.json" in last
    assert "serving" not in result.stderr


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "'a' is given twice"),
        (["--enable-lora", "--lora-modules", "no-path"], "'no-path' is not name=path"),
        (["--enable-lora", "--lora-modules", "=/x"], "is not name=path"),
        (["--enable-lora", "--served-model-name", "m", "--lora-modules", "m=/x"], "served model's name"),
        (["--enable-lora", "--lora-modules", '{"name": "a"'], "is not valid JSON"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "non-empty string 'path'"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "r": 4}'], "unknown keys ['r']"),
        (["--enable-lora", "--data-parallel-size", "2"], "enable_lora=True needs data_parallel_size=1"),
    ],
)
def test_bad_lora_flags_are_one_line_errors(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["serve", "some-model", *argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("pagedserve serve: "), err
    assert needle in lines[0], lines[0]


def test_lora_flag_errors_exit_2_from_the_shell() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli.main", "serve", "--lora-modules", "a=/x"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        "pagedserve serve: --lora-modules needs --enable-lora (the engine must be built with LoRA layers)"
    )


class _Outbox:
    """Stands in for the core's output socket: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


@pytest.mark.parametrize(
    ("pooling", "needle"),
    [(False, "built without LoRA"), (True, "a pooling request runs the base model only")],
)
def test_the_core_rejects_adapters_it_cannot_run(pooling: bool, needle: str) -> None:
    """A request naming an adapter that the core cannot run is rejected on arrival (REJECTED, the
    API answers 400) instead of failing the step, and every request in it, in the model runner."""
    from pagedserve.engine.protocol import EngineCoreRequest
    from pagedserve.pooling_params import PoolingParams
    from pagedserve.processes.engine_core import serialization as wire
    from pagedserve.processes.engine_core.engine_proc import EngineCoreLoop
    from pagedserve.types import RequestId

    outbox = _Outbox()
    loop = EngineCoreLoop(None, None, outbox, 0)  # type: ignore[arg-type]  # `_add` rejects before the core
    request = EngineCoreRequest(
        RequestId("r"),
        [1, 2],
        SamplingParams(max_tokens=1),
        frozenset(),
        pooling_params=PoolingParams() if pooling else None,
        lora_request=LoRARequest("sql", 1, "/adapters/sql"),
    )
    loop._add(request)
    (message,) = [wire.decode(data) for data in outbox.sent]
    assert message.kind is wire.MessageType.REJECTED and message.req_ids == ["r"]
    assert message.text is not None and needle in message.text
