"""`pagedserve serve --skip-tokenizer-init`: token-id prompts are served with token ids and empty
text (as vLLM's server does), so `pagedserve bench serve` can load a server that has no tokenizer;
what needs text (stop strings, chat, text prompts) is refused naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_support import ServerProcess, build_tiny_model, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    proc = start_server(
        model_dir, "--skip-tokenizer-init", "--max-model-len", "256", "--num-kv-blocks", "128"
    )
    try:
        yield proc
    finally:
        proc.stop()


def _post(server: ServerProcess, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": server.model_name, **body}, timeout=60)


def test_token_id_prompts_get_token_ids_and_empty_text(server: ServerProcess) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "ignore_eos": True, "logprobs": 1, "echo": True}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 6
    # Without text, the token ids are what the client gets, asked for or not (as vLLM's).
    assert choice["prompt_token_ids"] == [5, 6, 7, 8] and len(choice["token_ids"]) == 6
    r = _post(server, "/v1/completions", {"prompt": [[5, 6], [7, 8]], "max_tokens": 3, "stream": True})
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1])
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    for index, prompt in enumerate([[5, 6], [7, 8]]):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
        assert sum(len(c["token_ids"]) for c in mine) == 3


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5, 6], "stop": ["x"]}, "stop"),
        ("/v1/completions", {"prompt": "text needs a tokenizer"}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ],
)
def test_what_needs_text_is_refused_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, object], param: str
) -> None:
    r = _post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_bench_serve_loads_a_server_without_tokenizer(server: ServerProcess, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli.main", "bench", "serve", "--base-url", server.base_url,
         "--dataset", "random", "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4",
         "--vocab-size", "49152", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr + out.stdout
    summary = json.loads((tmp_path / "r.json").read_text())["summary"]
    assert summary["completed"] == 6 and summary["total_output_tokens"] == 6 * 4
