"""`AsyncLLMEngine` embedded in an asyncio program: generate, abort, bad requests, shutdown, the
front end's start-up heap frozen, and a big step's outputs applied in slices with the event loop
free between them."""

from __future__ import annotations

import asyncio
import gc
import itertools
from pathlib import Path
from typing import Any

import pytest
from server_support import build_tiny_model, pid_alive

from pagedserve.config import EngineArgs
from pagedserve.engine.protocol import EngineCoreOutput
from pagedserve.outputs import RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import OUTPUT_SLICE, AsyncLLMEngine, EngineDeadError, InvalidRequest


def test_generate_abort_and_shutdown(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    # 6 blocks of 16 tokens: less than one max_model_len request, so the core must reject some.
    args = EngineArgs(model=str(model), max_model_len=128, num_kv_blocks=6, block_size=16)

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args)
        core_pid = engine.core_pid
        assert core_pid is not None and engine.is_healthy
        # The front end's start-up objects are out of full collections, which would otherwise
        # walk them all, holding the GIL and so the event loop (gc.get_objects skips frozen ones).
        assert engine.tokenizer is not None
        assert not any(o is engine.tokenizer for o in gc.get_objects())
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


def test_a_step_is_applied_in_slices_with_the_loop_free_between(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step's outputs are detokenized on the event loop (a thread would take the GIL from it),
    so a step of many requests must not hold the loop: it is applied `OUTPUT_SLICE` requests at a
    time, other callbacks run between slices, and a request's samples stay in one slice (so it
    still gets one output per step). The outputs are those of an unsliced step."""
    model = build_tiny_model(tmp_path / "tiny")
    count = 3 * OUTPUT_SLICE + 1
    args = EngineArgs(model=str(model), max_model_len=128, block_size=16, max_num_seqs=4 * count)

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args)
        ticks = 0  # how many times the loop ran another task's callback
        stopped = False

        async def ticker() -> None:
            nonlocal ticks
            while not stopped:
                ticks += 1
                await asyncio.sleep(0)

        step = 0
        calls: list[tuple[int, int, list[str]]] = []  # (step, ticks, sequence ids) per process()
        processor = engine._processor
        assert processor is not None
        process = processor.process
        route_outputs = engine._route_outputs

        def recording_process(outputs: list[EngineCoreOutput]) -> Any:
            calls.append((step, ticks, [o.req_id for o in outputs]))
            return process(outputs)

        async def counting_route_outputs(*a: Any) -> None:
            nonlocal step
            step += 1
            await route_outputs(*a)

        monkeypatch.setattr(processor, "process", recording_process)
        monkeypatch.setattr(engine, "_route_outputs", counting_route_outputs)
        tick_task = asyncio.ensure_future(ticker())
        try:
            one = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
            two = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, n=2)

            async def final(request_id: str, params: SamplingParams) -> RequestOutput:
                outs = [o async for o in engine.generate(f"story {request_id[1:]}", params, request_id)]
                return outs[-1]

            # One sample each (cut by position), then some requests with two (cut by request).
            singles = await asyncio.gather(*(final(f"s{i}", one) for i in range(count)))
            steps_of_singles = step
            mixed = await asyncio.gather(*(final(f"m{i}", two if i % 4 == 0 else one) for i in range(count)))
            alone = [o async for o in engine.generate("story 1", one, "alone")][-1]
        finally:
            stopped = True
            await tick_task
            await engine.shutdown()
        for out in singles:
            assert out.finished and len(out.outputs[0].token_ids) == 6
        for i, out in enumerate(mixed):
            assert out.finished and [len(s.token_ids) for s in out.outputs] == [6] * (2 if i % 4 == 0 else 1)
        # Detokenized in a slice of a big step or alone, the same text.
        assert singles[1].outputs[0].text == mixed[1].outputs[0].text == alone.outputs[0].text

        by_step: dict[int, list[tuple[int, list[str]]]] = {}
        for s, t, seq_ids in calls:
            by_step.setdefault(s, []).append((t, seq_ids))
        split = [s for s, parts in by_step.items() if len(parts) > 1]
        assert any(s <= steps_of_singles for s in split), "no step of single samples was applied in slices"
        assert any(s > steps_of_singles for s in split), (
            "no step with two-sample requests was applied in slices"
        )
        for parts in by_step.values():
            owners = [{seq.split("#")[0] for seq in seq_ids} for _, seq_ids in parts]
            assert all(len(requests) <= OUTPUT_SLICE for requests in owners)
            # Every request in one slice of the step: its samples are never split.
            assert sum(len(requests) for requests in owners) == len(set().union(*owners))
            # The loop ran other work between one slice and the next.
            ticks_seen = [t for t, _ in parts]
            assert all(b > a for a, b in itertools.pairwise(ticks_seen)), ticks_seen

    asyncio.run(main())
