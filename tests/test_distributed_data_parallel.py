"""Data parallelism on cpu_reference: two engine-core processes behind one offline `LLM` and behind
one `AsyncLLMEngine` give every request the tokens one engine gives (greedy, and seeded sampling
with n > 1) and every pooling request its vector, in input order, with aborts, stop strings and
prefix-cache resets; both replicas get work; the throughput benchmark's loop runs over the
replicas; a killed replica fails the engine with an error naming it and leaves no process behind.

Each engine spawns one process per replica (seconds to start), so each of the two end-to-end
tests makes one and runs every check through it; placement and GPU assignment are tested pure.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from models_harness import save_checkpoint, tiny_hf_model
from server_support import build_tiny_model, pid_alive
from test_distributed_engine import CONFIGS, GREEDY, PROMPTS

from pagedserve import LLM, PoolingParams, SamplingParams
from pagedserve.bench.datasets import random_requests
from pagedserve.bench.throughput import StepRecord, run_throughput
from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.processes.data_parallel.balancer import LoadBalancer
from pagedserve.processes.data_parallel.offline_client import DataParallelCores, ReplicaFailedError
from pagedserve.processes.data_parallel.placement import gpu_groups, plan_replicas
from pagedserve.server.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.types import RequestId

ENGINE: dict[str, object] = dict(
    platform="cpu_reference", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=64
)
SERVER: dict[str, object] = dict(ENGINE, block_size=16, max_model_len=128)
SEEDED = [
    SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, detokenize=False),
    SamplingParams(
        temperature=0.8, top_k=20, seed=3, max_tokens=6, ignore_eos=True, logprobs=2, detokenize=False
    ),
]


def _tokens(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in o.outputs] for o in outputs]


def test_offline_dp2_equals_one_engine(tmp_path: Path) -> None:
    path = str(save_checkpoint(tiny_hf_model(CONFIGS["llama"](), seed=0), tmp_path / "llama"))
    one = LLM(path, skip_tokenizer_init=True, **ENGINE)
    greedy = one.generate(PROMPTS, GREEDY, use_tqdm=False)
    seeded_prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[4]]
    seeded_params = [SEEDED[0], SEEDED[1], SEEDED[0]]
    seeded = one.generate(seeded_prompts, seeded_params, use_tqdm=False)
    llm = LLM(path, skip_tokenizer_init=True, data_parallel_size=2, **ENGINE)
    engine = llm.engine
    # One front end whatever the replica count: the same LLMEngine, over the replicas' client.
    assert type(engine) is LLMEngine and isinstance(engine.client, DataParallelCores)
    assert llm.platform == "cpu_reference"
    with pytest.raises(AttributeError, match="data_parallel_size=2 each replica's runs in its own process"):
        _ = engine.core
    pids = [pid for pid in engine.client.replica_pids if pid is not None]
    try:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in got] == PROMPTS  # input order
        assert _tokens(got) == _tokens(greedy)
        assert all(n > 0 for n in engine.client.balancer.placed), engine.client.balancer.placed
        # The same batch is placed the same way: the second pass hits each replica's cache,
        # until the cache is reset on every replica.
        assert sum(o.num_cached_tokens for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)) > 0
        llm.reset_prefix_cache()
        assert sum(o.num_cached_tokens for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 0

        # n > 1 (forks stay on their parent's replica) and seeds: the same samples.
        got_seeded = llm.generate(seeded_prompts, seeded_params, use_tqdm=False)
        assert _tokens(got_seeded) == _tokens(seeded)
        # Logprobs too, up to float rounding (a replica batches and threads differently).
        got_lp, want_lp = got_seeded[1].outputs[0].logprobs, seeded[1].outputs[0].logprobs
        assert got_lp is not None and want_lp is not None and len(got_lp) == len(want_lp) == 6
        for got_pos, want_pos in zip(got_lp, want_lp, strict=True):
            assert {t: lp.rank for t, lp in got_pos.items()} == {t: lp.rank for t, lp in want_pos.items()}
            for token, lp in got_pos.items():
                assert lp.logprob == pytest.approx(want_pos[token].logprob, abs=1e-4)

        # Abort: the aborted request ends with "abort", its neighbour runs to the end.
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, detokenize=False)
        engine.add_request("keep", PROMPTS[0], long)
        engine.add_request("drop", PROMPTS[1], long)
        finals = {o.request_id: o for o in engine.step() if o.finished}  # both are running now
        aborted = engine.abort_request("drop")
        assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        assert set(finals) == {"keep"} and len(finals["keep"].outputs[0].token_ids) == 40
        assert engine.scheduler_counts() == (0, 0)  # the abort freed the replica's request

        # The throughput benchmark's loop runs over the replicas (each request to its exact length).
        trace: list[StepRecord] = []
        work = random_requests(12, input_len=9, output_len=7, vocab_size=101, range_ratio=0.5, seed=1)
        result = run_throughput(engine, work, trace)
        assert result.output_tokens == sum(r.output_len for r in work) and trace

        # A request that cannot fit is refused at once, as by one engine.
        with pytest.raises(ValueError, match=r"prompt 0: .*exceeds max_model_len"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=100, detokenize=False), use_tqdm=False)

        # A killed replica fails the engine, naming it; the other replica is stopped too.
        os.kill(pids[1], signal.SIGKILL)
        died = r"data-parallel replica 1 \(pid \d+\): the engine core process exited unexpectedly \(killed"
        with pytest.raises(ReplicaFailedError, match=died):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert not any(pid_alive(pid) for pid in pids)
        with pytest.raises(ReplicaFailedError, match="shut down after a replica failed"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        engine.shutdown()
    assert not any(pid_alive(pid) for pid in pids)


def test_server_dp2_serves_places_and_reports_a_dead_replica(tmp_path: Path) -> None:
    model = str(build_tiny_model(tmp_path / "tiny"))
    one = LLM(model, **SERVER)
    prompts = ["Hello", "The capital of France is", "1, 2, 3,", "Once upon a time", "x y z", "def f():"]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    expected = one.generate(prompts, params, use_tqdm=False)
    embeddings = one.embed(prompts, use_tqdm=False)
    text = expected[1].outputs[0].text
    stop = text[len(text) // 2 :][:3]  # cut where one engine's greedy text has it
    args = EngineArgs.model_validate({**SERVER, "model": model, "data_parallel_size": 2})

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(args)
        pids = [pid for pid in engine.core_pids if pid is not None]
        assert len(pids) == 2 and engine.is_healthy
        try:
            finals = await asyncio.gather(
                *(_last(engine.generate(p, params, f"r{i}")) for i, p in enumerate(prompts))
            )
            assert [o.outputs[0].token_ids for o in finals] == [o.outputs[0].token_ids for o in expected]
            assert all(n > 0 for n in engine.requests_placed), engine.requests_placed

            # Pooling requests are spread over the replicas too, and give one engine's vectors.
            placed = engine.requests_placed
            pooled = await asyncio.gather(
                *(engine.encode(p, PoolingParams(), f"e{i}") for i, p in enumerate(prompts))
            )
            for got, want in zip(pooled, embeddings, strict=True):
                assert got.prompt_token_ids == want.prompt_token_ids
                torch.testing.assert_close(got.outputs.data, torch.tensor(want.outputs.embedding))
            assert all(now > before for now, before in zip(engine.requests_placed, placed, strict=True))

            # A stop string is matched here; its replica is told to stop and frees the blocks.
            stopped = await _last(engine.generate(prompts[1], _with_stop(params, stop), "s"))
            assert stopped.outputs[0].finish_reason == "stop"
            assert stopped.outputs[0].text == text[: text.index(stop)]
            for _ in range(100):
                if engine.stats is not None and engine.stats.num_kv_blocks_in_use == 0:
                    break
                await asyncio.sleep(0.05)
            assert engine.stats is not None and engine.stats.num_kv_blocks_in_use == 0

            # Replica 1 dies with two requests in flight (one on each replica): both fail.
            long = SamplingParams(max_tokens=100, ignore_eos=True)
            streams = [engine.generate("a b", long, "long0"), engine.generate("c d", long, "long1")]
            for stream in streams:
                await anext(stream)
            os.kill(pids[1], signal.SIGKILL)
            start = time.monotonic()
            for stream in streams:
                with pytest.raises(EngineDeadError, match=r"data-parallel replica 1 \(pid \d+\)"):
                    await asyncio.wait_for(_last(stream), 30)
            assert time.monotonic() - start < 15
            assert not engine.is_healthy
            reason = engine.dead_reason
            assert reason is not None and "exited unexpectedly (killed by signal 9)" in reason
            for _ in range(100):  # the surviving replica is told to stop at once
                if not pid_alive(pids[0]):
                    break
                await asyncio.sleep(0.1)
            assert not pid_alive(pids[0]), "the other replica outlived the failure"
        finally:
            await engine.shutdown()
        assert not any(pid_alive(pid) for pid in pids), "a replica outlived the engine"

    asyncio.run(main())


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None and last.finished
    return last


def _with_stop(params: SamplingParams, stop: str) -> SamplingParams:
    return SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, temperature=0.0, stop=[stop])


def test_bad_sizes_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM("unused", data_parallel_size=0)
    gpus = ["0", "1", "2"]
    with pytest.raises(
        ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs but 3 are visible"
    ):
        gpu_groups(2, 2, gpus)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match="data_parallel_size=2 x tensor_parallel_size=1 needs 2 GPUs but 1"):
        plan_replicas(EngineArgs(data_parallel_size=2), "cuda")


def test_gpu_assignment_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_groups(2, 2, ["0", "1", "2", "3", "4"]) == ["0,1", "2,3"]  # the first N x T
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    plans = plan_replicas(EngineArgs(data_parallel_size=2, tensor_parallel_size=2), "cuda")
    assert [p.gpus for p in plans] == ["4,5", "6,7"]
    assert all(p.env["NCCL_NVLS_ENABLE"] == "0" and p.torch_threads is None for p in plans)
    cpu = plan_replicas(EngineArgs(data_parallel_size=2), "cpu")
    assert all(p.gpus is None and p.torch_threads is not None and p.torch_threads >= 1 for p in cpu)
    # One replica is the engine without data parallelism: nothing changes for its process.
    (only,) = plan_replicas(EngineArgs(), "cuda")
    assert not only.env and only.torch_threads is None


def test_balancer_places_on_least_queued_work() -> None:
    lb = LoadBalancer(2)
    ids = [RequestId(f"r{i}") for i in range(4)]
    assert lb.place([ids[0]], prompt_len=100, max_tokens=10) == 0  # tie: lowest index
    assert lb.place([ids[1]], prompt_len=10, max_tokens=10) == 1
    assert lb.place([ids[2]], prompt_len=10, max_tokens=10) == 1  # 20 < 110 queued
    assert lb.load == (110, 40)
    # Samples of one request share a replica; forks share the parent's prompt.
    forks = [RequestId("n#0"), RequestId("n#1"), RequestId("n#2")]
    assert lb.place(forks, prompt_len=10, max_tokens=5) == 1
    assert lb.load == (110, 40 + 10 + 3 * 5)
    assert {lb.replica_of(f) for f in forks} == {1}
    lb.on_output(ids[0], 1, finished=False)  # the prompt is computed, one token generated
    assert lb.load[0] == 9
    lb.on_output(ids[0], 2, finished=True)
    assert lb.load[0] == 0 and lb.replica_of(ids[0]) is None
    assert lb.place([ids[3]], prompt_len=1, max_tokens=1) == 0
    for seq in [ids[1], ids[2], ids[3], *forks]:
        lb.forget(seq)
    assert lb.load == (0, 0) and not lb.has_unfinished()
    assert lb.placed == [2, 3]
