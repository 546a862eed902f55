"""Data parallelism over Ray actors on a local Ray cluster (cpu_reference, `ray.init(num_cpus=2)`):
two replica actors behind one offline `LLM` and behind one `AsyncLLMEngine` give every request the
tokens one engine gives, with aborts, stop strings and prefix-cache resets; both replicas get work;
a replica whose actor process is killed fails the engine naming it; neither a failure nor a
shutdown leaves an actor, a process or a placement group behind; a cluster too small is refused.
Skipped when Ray is not installed (`pip install 'pagedserve[ray]'`)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from models_harness import save_checkpoint, tiny_hf_model
from server_support import pid_alive
from test_distributed_engine import CONFIGS, VOCAB
from test_distributed_engine import PROMPTS as ID_PROMPTS
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.outputs import RequestOutput
from pagedserve.processes.data_parallel.offline_client import DataParallelCores, ReplicaFailedError
from pagedserve.server.async_engine import AsyncLLMEngine

ray = pytest.importorskip("ray")

from pagedserve.processes.data_parallel.ray_replicas import (  # noqa: E402  - needs ray
    RayReplica,
    death_cause,
    replica_bundle,
)

RAY: dict[str, object] = dict(data_parallel_size=2, distributed_executor_backend="ray")
ENGINE: dict[str, object] = dict(
    platform="cpu_reference", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=64
)
# Text prompts over a word-level tokenizer of the test model's vocabulary (built in a moment,
# unlike a real tokenizer): the front ends tokenize, detokenize and match stop strings.
PROMPTS = [" ".join(f"w{i}" for i in ids) for ids in ID_PROMPTS]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Mistral (its greedy tokens vary; some tiny models repeat one token) and a
    tokenizer whose token i is the word `w<i>`."""
    path = save_checkpoint(tiny_hf_model(CONFIGS["mistral"](), seed=0), tmp_path_factory.mktemp("tiny"))
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def expected(model: str) -> list[RequestOutput]:
    """What one in-process engine gives."""
    return LLM(model, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)


def _nothing_left(pids: list[int]) -> None:
    """Every replica process has exited, every actor is dead and the placement group is gone (its
    CPUs are free again). Actors are read from Ray's control store (the state API needs the
    dashboard, which the test cluster does not start)."""
    deadline = time.monotonic() + 15
    while True:
        alive = [p for p in pids if pid_alive(p)]
        actors = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        cpus = ray.available_resources().get("CPU")
        if not alive and not actors and not groups and cpus == 2.0:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: pids {alive}, actors {actors}, groups {groups}, CPUs {cpus}")
        time.sleep(0.1)


def _stop_string(expected: list[RequestOutput]) -> str:
    """Three characters from the middle of one engine's greedy text of prompt 1."""
    text = expected[1].outputs[0].text
    return text[len(text) // 2 :][:3]


def _with_stop(stop: str) -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, stop=[stop])


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_offline_dp2_over_ray_equals_one_engine_and_fails_naming_a_killed_replica(
    local_cluster: None, model: str, expected: list[RequestOutput]
) -> None:
    llm = LLM(model, **RAY, **ENGINE)
    engine = llm.engine
    assert isinstance(engine.client, DataParallelCores) and llm.platform == "cpu_reference"
    assert all(isinstance(r.handle, RayReplica) for r in engine.client._replicas)
    pids = [pid for pid in engine.client.replica_pids if pid is not None]
    assert len(pids) == 2 and os.getpid() not in pids
    try:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in got] == ID_PROMPTS  # input order
        assert _tokens(got) == _tokens(expected) and len(set(map(tuple, _tokens(got)))) > 1
        assert all(n > 0 for n in engine.client.balancer.placed), engine.client.balancer.placed
        # The same batch lands the same way: the second pass hits each replica's prefix cache.
        assert sum(o.num_cached_tokens for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)) > 0
        assert llm.reset_prefix_cache() > 0
        assert sum(o.num_cached_tokens for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == 0

        # A stop string is matched here; its replica is told to stop the request.
        stop = _stop_string(expected)
        (stopped,) = llm.generate([PROMPTS[1]], _with_stop(stop), use_tqdm=False)
        text = expected[1].outputs[0].text
        assert stopped.outputs[0].finish_reason == "stop"
        assert stopped.outputs[0].text == text[: text.index(stop)]

        # Abort: the aborted request ends with "abort", its neighbour runs to the end.
        long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, detokenize=False)
        engine.add_request("keep", PROMPTS[0], long)
        engine.add_request("drop", PROMPTS[1], long)
        finals = {o.request_id: o for o in engine.step() if o.finished}
        aborted = engine.abort_request("drop")
        assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        assert set(finals) == {"keep"} and len(finals["keep"].outputs[0].token_ids) == 30
        assert engine.scheduler_counts() == (0, 0)  # the stop and the abort freed their requests

        # A killed replica actor fails the engine at once, naming it; the other one is stopped.
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        died = (
            r"data-parallel replica 1 \(pid \d+, node [\d.]+\): the engine core process exited "
            r"unexpectedly \(Ray reports the actor dead"
        )
        with pytest.raises(ReplicaFailedError, match=died):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 15
        _nothing_left(pids)
        with pytest.raises(ReplicaFailedError, match="shut down after a replica failed"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    finally:
        engine.shutdown()
    _nothing_left(pids)


def test_server_dp2_over_ray_serves_and_shuts_down_cleanly(
    local_cluster: None, model: str, expected: list[RequestOutput]
) -> None:
    args = EngineArgs.model_validate({**ENGINE, **RAY, "model": model})

    async def main() -> list[int]:
        engine = await AsyncLLMEngine.launch(args)
        pids = [pid for pid in engine.core_pids if pid is not None]
        assert len(pids) == 2 and engine.is_healthy
        try:
            finals = await asyncio.gather(
                *(_last(engine.generate(p, GREEDY, f"r{i}")) for i, p in enumerate(PROMPTS))
            )
            assert _tokens(finals) == _tokens(expected)
            assert all(n > 0 for n in engine.requests_placed), engine.requests_placed
            stop = _stop_string(expected)
            stopped = await _last(engine.generate(PROMPTS[1], _with_stop(stop), "s"))
            text = expected[1].outputs[0].text
            assert stopped.outputs[0].text == text[: text.index(stop)]
        finally:
            await engine.shutdown()
        return pids

    _nothing_left(asyncio.run(main()))


def test_a_cluster_too_small_is_refused_listing_its_resources(local_cluster: None) -> None:
    # Two replicas of two ranks need (1 + 2) CPUs each; the cluster has 2.
    with pytest.raises(
        ValueError, match=r"cannot place 2 data-parallel replicas of \{'CPU': 3\.0\} .*'CPU': 2\.0"
    ):
        LLM("unused", tensor_parallel_size=2, distributed_timeout_s=1.0, **RAY, **ENGINE)
    _nothing_left([])


def test_bundles_and_death_causes() -> None:
    assert replica_bundle(1, use_gpus=True) == {"CPU": 1.0, "GPU": 1.0}
    assert replica_bundle(4, use_gpus=True) == {"CPU": 5.0, "GPU": 4.0}  # the core and its ranks
    assert replica_bundle(2, use_gpus=False) == {"CPU": 3.0}
    report = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: _ReplicaActor\n"
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
        "Worker exit detail: Worker unexpectedly exits"
    )
    assert death_cause(RuntimeError(report)) == (
        "Ray reports the actor dead: its worker process has died (exit type SYSTEM_ERROR)"
    )
    assert death_cause(RuntimeError("gone\nmore")) == "Ray reports the actor dead: gone"


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None and last.finished
    return last
