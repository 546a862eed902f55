"""`AsyncLLMEngine` embedded in an asyncio program: generate, abort, bad requests, shutdown."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from server_support import build_tiny_model, pid_alive

from pagedserve.config import EngineArgs
from pagedserve.outputs import RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import AsyncLLMEngine, EngineDeadError, InvalidRequest


def test_generate_abort_and_shutdown(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    # 6 blocks of 16 tokens: less than one max_model_len request, so the core must reject some.
    args = EngineArgs(model=str(model), max_model_len=128, num_kv_blocks=6, block_size=16)

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args)
        core_pid = engine.core_pid
        assert core_pid is not None and engine.is_healthy
        try:
            params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
            outs: list[RequestOutput] = [o async for o in engine.generate("Hello", params, "a")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            assert all(not o.finished for o in outs[:-1])
            # The same prompt as token ids gives the same greedy text.
            ids = engine.tokenize("Hello")
            again = [o async for o in engine.generate(ids, params, "b")][-1]
            assert again.outputs[0].text == outs[-1].outputs[0].text

            # abort() ends a running generate loop with finish_reason "abort".
            long = SamplingParams(max_tokens=60, ignore_eos=True)
            seen: list[RequestOutput] = []

            async def consume() -> None:
                async for o in engine.generate("x", long, "c"):
                    seen.append(o)
                    if len(seen) == 1:
                        engine.abort("c")

            await asyncio.wait_for(consume(), 30)
            assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"

            # Cancelling the consumer aborts too; the engine frees the blocks.
            started = asyncio.Event()

            async def consume_until_cancelled() -> None:
                async for _ in engine.generate("y", long, "d"):
                    started.set()

            task = asyncio.ensure_future(consume_until_cancelled())
            await asyncio.wait_for(started.wait(), 30)
            task.cancel()  # 59 more tokens to go: the request is surely still running
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if engine.stats is not None and engine.stats.num_kv_blocks_in_use == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.stats is not None and engine.stats.num_kv_blocks_in_use == 0
            assert engine.num_unfinished_requests == 0

            with pytest.raises(InvalidRequest) as exc:
                await _drain(engine.generate("z", SamplingParams(max_tokens=200), "e"))
            assert exc.value.param == "max_tokens"
            with pytest.raises(InvalidRequest, match="prompt"):
                await _drain(engine.generate([10**6], params, "f"))
            # Fits max_model_len but not the whole KV cache: the core process rejects it.
            with pytest.raises(InvalidRequest, match="KV blocks"):
                await _drain(engine.generate([5], SamplingParams(max_tokens=120), "h"))
            assert engine.num_unfinished_requests == 0
            after = [o async for o in engine.generate("ok", params, "i")][-1]  # still serving
            assert after.finished and len(after.outputs[0].token_ids) == 4
        finally:
            await engine.shutdown()
        assert not pid_alive(core_pid)
        with pytest.raises(EngineDeadError):
            await _drain(engine.generate("late", SamplingParams(max_tokens=1), "g"))

    asyncio.run(main())


async def _drain(stream: object) -> None:
    async for _ in stream:  # type: ignore[attr-defined]
        pass
