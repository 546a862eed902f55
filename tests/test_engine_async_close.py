"""Leaving an `AsyncLLMEngine` stream early is done when it returns: once `aclose()` (or the
cancelled task that iterated the stream) is over, the engine no longer counts the request as
unfinished, however late the engine's thread gets to the abort; and a consumer cancelled while its
request is still being added leaves nothing behind. Hooks hold the abort (or the add) on the
engine's thread until the test lets it go, so the order is forced, not timed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from server_support import build_tiny_model

from pagedserve.engine.arg_utils import AsyncEngineArgs
from pagedserve.engine.async_llm_engine import AsyncLLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams

ENGINE = {"max_model_len": 128, "num_kv_blocks": 64, "block_size": 16, "platform": "cpu_reference"}
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
SPINS = 20  # event-loop turns a close that does not wait for the abort needs to finish (it needs 1)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def aengine(model: str) -> Iterator[AsyncLLMEngine]:
    """One per test: an engine serves the event loop it was first used on."""
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, **ENGINE))
    yield engine
    engine.shutdown()


@pytest.fixture
def release(aengine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Aborts wait on the engine's thread until this event is set (set at the end in any case)."""
    gate = threading.Event()
    abort = aengine.engine.abort_request

    def held_abort(request_id: str) -> RequestOutput | None:
        assert gate.wait(timeout=60), "the test never released the abort"
        return abort(request_id)

    monkeypatch.setattr(aengine.engine, "abort_request", held_abort)
    yield gate
    gate.set()


async def _spin() -> None:
    for _ in range(SPINS):
        await asyncio.sleep(0)


def test_aclose_returns_once_the_engine_dropped_the_request(aengine: AsyncLLMEngine) -> None:
    async def main() -> None:
        stream = aengine.generate([1, 2, 3], LONG, "closed")
        first = await anext(stream)
        assert not first.finished
        await stream.aclose()
        assert not aengine.engine.has_unfinished_requests()

    asyncio.run(main())


def test_aclose_waits_for_an_abort_the_engine_thread_is_slow_to_run(
    aengine: AsyncLLMEngine, release: threading.Event
) -> None:
    async def main() -> None:
        stream = aengine.generate([1, 2, 3], LONG, "slow-close")
        await anext(stream)
        closing = asyncio.ensure_future(stream.aclose())
        await _spin()
        assert not closing.done()  # the abort is held on the engine's thread, so the close waits
        release.set()
        await closing
        assert not aengine.engine.has_unfinished_requests()
        await aengine.abort([])  # and an awaited abort after it finds nothing left either
        assert not aengine.engine.has_unfinished_requests()

    asyncio.run(main())


def test_a_cancelled_consumer_ends_once_the_engine_dropped_the_request(
    aengine: AsyncLLMEngine, release: threading.Event
) -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in aengine.generate([1, 2, 3], LONG, "cancelled"):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        await _spin()
        assert not task.done()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not aengine.engine.has_unfinished_requests()

    asyncio.run(main())


def test_a_consumer_cancelled_while_its_request_is_added_leaves_nothing_behind(
    aengine: AsyncLLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    add = aengine.engine.add_request

    def held_add(*args: Any, **kwargs: Any) -> None:
        entered.set()
        assert release.wait(timeout=60), "the test never released the add"
        add(*args, **kwargs)

    monkeypatch.setattr(aengine.engine, "add_request", held_add)

    async def main() -> None:
        task = asyncio.ensure_future(anext(aengine.generate([1, 2, 3], LONG, "adding")))
        assert await asyncio.to_thread(entered.wait, 60)
        task.cancel()  # while the engine's thread is still adding the request
        await _spin()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await aengine.abort([])  # runs after the add on the engine's thread
        assert not aengine.engine.has_unfinished_requests()

    try:
        asyncio.run(main())
    finally:
        release.set()
