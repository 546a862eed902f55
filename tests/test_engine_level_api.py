"""vLLM's engine level with only the import changed: `EngineArgs` / `AsyncEngineArgs` from
`pagedserve.engine.arg_utils`, `LLMEngine.from_engine_args`, its `add_request` (prompt dicts),
`abort_request` (one id or a list), `has_unfinished_requests` and `get_tokenizer`, and the
in-process `AsyncLLMEngine` of `pagedserve.engine.async_llm_engine`, which needs no ZeroMQ."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import pytest
from server_support import build_tiny_model

import pagedserve
from pagedserve.config import EngineArgs as ConfigEngineArgs
from pagedserve.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagedserve.engine.async_llm_engine import AsyncEngineDeadError, AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.inputs import TokensPrompt
from pagedserve.outputs import RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import RequestOutputKind, SamplingParams

ENGINE = {"max_model_len": 128, "num_kv_blocks": 64, "block_size": 16, "platform": "cpu_reference"}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def engine(model: str) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=model, **ENGINE))


def _run(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, RequestOutput) and out.finished:
                finished[out.request_id] = out
    return finished


def test_the_engine_level_names_import_from_where_vllm_has_them() -> None:
    assert pagedserve.EngineArgs is EngineArgs is ConfigEngineArgs
    assert pagedserve.AsyncEngineArgs is AsyncEngineArgs and issubclass(AsyncEngineArgs, EngineArgs)
    # The engine's classes with the process layer supplied (tensor and data parallelism).
    assert issubclass(pagedserve.LLMEngine, LLMEngine)
    assert issubclass(pagedserve.AsyncLLMEngine, AsyncLLMEngine)
    assert pagedserve.TokensPrompt is TokensPrompt
    with pytest.raises(ValueError, match="disable_log_requests"):  # no switch pagedserve lacks is ignored
        AsyncEngineArgs(disable_log_requests=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="must be an EngineArgs"):
        LLMEngine.from_engine_args({"model": "x"})  # type: ignore[arg-type]


def test_from_engine_args_builds_the_engine_llm_builds(engine: LLMEngine, model: str) -> None:
    assert engine.args == EngineArgs(model=model, **ENGINE) and engine.platform_name == "cpu_reference"
    tokenizer = engine.get_tokenizer()
    assert tokenizer is engine.tokenizer and tokenizer.encode("Hello") == engine.tokenize("Hello")
    bare = LLMEngine.from_engine_args(EngineArgs(model=model, skip_tokenizer_init=True, **ENGINE))
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.get_tokenizer()


def test_add_request_reads_a_prompt_dict_as_vllm_does(engine: LLMEngine) -> None:
    text = "The capital of France is"
    ids = engine.tokenize(text)
    engine.add_request("text", text, GREEDY)
    engine.add_request("text-dict", {"prompt": text}, GREEDY)
    engine.add_request("ids-dict", TokensPrompt(prompt_token_ids=ids), GREEDY)
    finished = _run(engine)
    assert finished["text-dict"].prompt == text and finished["text-dict"].prompt_token_ids == ids
    want = finished["text"].outputs[0].token_ids
    assert finished["text-dict"].outputs[0].token_ids == want == finished["ids-dict"].outputs[0].token_ids
    with pytest.raises(ValueError, match=r"unknown prompt key\(s\) \['text'\]"):
        engine.add_request("bad", {"text": text}, GREEDY)
    assert not engine.has_unfinished_requests()


def test_abort_request_takes_one_id_or_a_list_and_leaves_nothing_unfinished(engine: LLMEngine) -> None:
    for rid in ("a", "b", "c"):
        engine.add_request(rid, [1, 2, 3, 4, 5], LONG)
    engine.step()
    assert engine.abort_request(["a", "b", "unknown"]) is None
    assert engine.has_unfinished_requests()  # "c" still runs
    final = engine.abort_request("c")
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    # At once, as vLLM's: no step is needed for the engine to know it is idle.
    assert not engine.has_unfinished_requests()
    assert not engine.core.has_unfinished_requests()  # and the core holds nothing either
    assert engine.core.scheduler.kv.stats().num_blocks_in_use == 0
    assert engine.step() == []


def test_llm_holds_the_engine_front_end(model: str) -> None:
    llm = pagedserve.LLM(model, **ENGINE)
    assert type(llm.llm_engine) is LLMEngine and llm.platform == "cpu_reference"


def _collect(engine: AsyncLLMEngine, prompt: object, rid: str, params: SamplingParams) -> list[RequestOutput]:
    async def main() -> list[RequestOutput]:
        return [out async for out in engine.generate(prompt, params, rid)]  # type: ignore[arg-type]

    return asyncio.run(main())


def test_async_engine_streams_what_the_engine_generates(engine: LLMEngine, model: str) -> None:
    engine.add_request("want", "Once upon a time", GREEDY)
    want = _run(engine)["want"].outputs[0]
    aengine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=model, **ENGINE))
    try:

        async def main() -> None:
            streamed = [out async for out in aengine.generate({"prompt": "Once upon a time"}, GREEDY, "r1")]
            assert [len(o.outputs[0].token_ids) for o in streamed] == list(range(1, 7))  # cumulative
            assert streamed[-1].finished and streamed[-1].outputs[0].text == want.text
            final_only = SamplingParams(temperature=0, max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
            (only,) = [out async for out in aengine.generate("Once upon a time", final_only, "r2")]
            assert only.outputs[0].token_ids == want.token_ids

            # Two streams at once; one is aborted from outside and ends with its aborted output.
            async def consume(rid: str) -> list[RequestOutput]:
                return [out async for out in aengine.generate([1, 2, 3], LONG, rid)]

            keep, drop = asyncio.create_task(consume("keep")), asyncio.create_task(consume("drop"))
            await asyncio.sleep(0.05)
            await aengine.abort(["drop"])
            kept, dropped = await keep, await drop
            assert len(kept[-1].outputs[0].token_ids) == 40
            assert dropped[-1].outputs[0].finish_reason == "abort"

            # Closing the stream early (or cancelling its task) aborts the request.
            stream = aengine.generate([1, 2, 3], LONG, "left")
            await anext(stream)
            await stream.aclose()  # returns once the engine dropped the request
            assert not aengine.engine.has_unfinished_requests()
            await aengine.abort([])
            assert not aengine.engine.has_unfinished_requests()

            (vector,) = [out async for out in aengine.encode("Hello", PoolingParams(), "emb")]
            assert vector.finished and len(vector.outputs.data) == 32
            tokenizer = await aengine.get_tokenizer()
            assert tokenizer.encode("Hello") == aengine.engine.tokenize("Hello")
            with pytest.raises(ValueError, match="max_model_len"):
                async for _ in aengine.generate([1] * 200, GREEDY, "too-long"):
                    pass

        asyncio.run(main())
        assert not aengine.is_running and not aengine.errored
    finally:
        aengine.shutdown()
    assert aengine.errored
    with pytest.raises(AsyncEngineDeadError, match="shut down"):
        _collect(aengine, "Hello", "late", GREEDY)


def test_async_engine_needs_no_zeromq(model: str) -> None:
    """The base install has no pyzmq, msgspec or FastAPI: the async engine runs without them."""
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        for name in ("zmq", "msgspec", "fastapi", "uvicorn"):
            sys.modules[name] = None  # importing them now raises ImportError
        from pagedserve import AsyncEngineArgs, AsyncLLMEngine, SamplingParams

        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model={model!r}, **{ENGINE!r}))
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

        async def main():
            return [o async for o in engine.generate("Hello", params, "r")]

        outs = asyncio.run(main())
        engine.shutdown()
        print("tokens", len(outs[-1].outputs[0].token_ids))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("tokens 3")
