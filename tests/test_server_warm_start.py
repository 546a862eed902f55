"""The first request after start-up finds its first-use work done: the engine core's warm-up
request (and that it leaves no trace), the tokenizer's vocabulary scan and chat template, and the
imports of the first streamed response."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from server_support import build_tiny_model

from pagedserve.config import EngineArgs
from pagedserve.engine.core import EngineCore
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.protocol import EngineCoreRequest
from pagedserve.engine.setup import build_engine
from pagedserve.kv_cache.stats import KVCacheCounters
from pagedserve.models.loader import load_tokenizer
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.warm_start import warm_up_tokenizer
from pagedserve.types import RequestId


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _engine(model_dir: Path) -> EngineCore:
    # One-token blocks: the warm-up's prompt fills a block, which the prefix cache registers.
    args = EngineArgs(model=str(model_dir), max_model_len=64, num_kv_blocks=64, block_size=1)
    return build_engine(args, offline=False).core


def _greedy(core: EngineCore, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    core.add_request(EngineCoreRequest(RequestId("r"), prompt, params, frozenset()))
    tokens: list[int] = []
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_engine_core_warm_up_runs_a_request_and_leaves_no_trace(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = _engine(model_dir)
    steps: list[object] = []

    class Counted:
        """The engine's runner, keeping the arguments of every step it executes."""

        def __init__(self, runner: Any) -> None:
            self.runner = runner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.runner, name)

        def execute(self, *args: Any) -> Any:
            steps.append(args)
            return self.runner.execute(*args)

    assert core.pipeline is None  # steps run synchronously, through core.runner
    monkeypatch.setattr(core, "runner", Counted(core.runner))
    core.warm_up()
    assert len(steps) >= 4  # each request: its prompt step and a decode step ran the model
    assert not core.has_unfinished_requests()
    stats = core.scheduler.stats().kv_cache
    assert stats.num_blocks_in_use == 0 and stats.num_cached_blocks == 0
    assert stats.counters == KVCacheCounters()  # /metrics counts only the clients' requests
    # The next request runs as on an engine that never warmed up.
    prompt = [5, 17, 300, 4000, 9]
    assert _greedy(core, prompt) == _greedy(_engine(model_dir), prompt)


def test_the_first_text_prompt_does_not_scan_the_vocabulary(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(model_dir)
    token_bytes = warm_up_tokenizer(tokenizer)
    lazy = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=64)
    assert lazy.max_text_bytes() == 2 * 64 * token_bytes

    inputs = InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=64, token_bytes=token_bytes)

    def scan(*args: object, **kwargs: object) -> object:
        raise AssertionError("the vocabulary was scanned during a request")

    monkeypatch.setattr(tokenizer, "convert_ids_to_tokens", scan)
    assert inputs.tokenize("Hello, world") == tokenizer.encode("Hello, world")


def test_the_first_streamed_response_imports_nothing() -> None:
    # A fresh interpreter: this one may have imported anything already.
    script = textwrap.dedent(
        """
        import asyncio, sys
        import pagedserve.server.api_server  # what the API process imports before serving
        from starlette.responses import StreamingResponse
        from pagedserve.server.warm_start import warm_up_streaming

        async def chunks():
            yield b"data: 1\\n\\n"
            yield b"data: [DONE]\\n\\n"

        async def receive():
            await asyncio.sleep(3600)

        async def main():
            await warm_up_streaming()
            sent = []

            async def send(message):
                sent.append(message)

            before = set(sys.modules)
            scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
            await StreamingResponse(chunks(), media_type="text/event-stream")(scope, receive, send)
            assert [m["type"] for m in sent][0] == "http.response.start" and len(sent) == 4, sent
            print(sorted(set(sys.modules) - before))

        asyncio.run(main())
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
