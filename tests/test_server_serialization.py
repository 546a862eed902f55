"""The engine wire format: every message survives encode -> decode unchanged, and a malformed
message is refused with WireError instead of being half-applied."""

from __future__ import annotations

import msgspec
import pytest

from pagedserve.engine.protocol import EngineCoreOutput, EngineCoreRequest
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import Logprob
from pagedserve.pooling_params import PoolingParams
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import CoreInfo, CoreStats, MessageType, WireError
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.types import RequestId


def test_add_round_trip_keeps_every_sampling_field() -> None:
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        seed=123,
        stop=["\n\n", "END"],
        stop_token_ids=[7, 8],
        ignore_eos=True,
        max_tokens=33,
        min_tokens=2,
        logprobs=3,
        prompt_logprobs=1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        logit_bias={42: -3.5, 7: 1.0},
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    req = EngineCoreRequest(
        req_id=RequestId("r#1"),
        prompt_token_ids=[1, 2, 3],
        sampling_params=params,
        eos_token_ids=frozenset({2, 0}),
        fork_of=RequestId("r#0"),
        cache_salt="tenant",
        priority=3,
    )
    msg = wire.decode(wire.encode_add(req))
    assert msg.kind is MessageType.ADD
    assert msg.request == req


def test_lora_request_round_trip() -> None:
    """A request's adapter crosses to the core with the request, every sample of it; the other
    fields keep their places."""
    lora = LoRARequest("sql", 3, "/adapters/sql")
    params = SamplingParams(n=2, temperature=0.0, max_tokens=4)
    reqs = [
        EngineCoreRequest(RequestId("r#0"), [1, 2], params, frozenset({2}), lora_request=lora),
        EngineCoreRequest(
            RequestId("r#1"), [1, 2], params, frozenset({2}), RequestId("r#0"), lora_request=lora
        ),
        EngineCoreRequest(RequestId("b"), [1, 2], params, frozenset({2}), cache_salt="s", priority=1),
    ]
    for req in reqs:
        assert wire.decode(wire.encode_add(req)).request == req
    assert wire.decode(wire.encode_add_many(reqs)).requests == reqs
    raw = msgspec.msgpack.decode(wire.encode_add(reqs[0]))
    assert raw[1][8] == ["sql", 3, "/adapters/sql"] and raw[1][5:8] == [None, 0, None]
    raw[1][8][1] = 0  # 0 stands for "no adapter": never an adapter's id
    with pytest.raises(WireError, match="lora_int_id"):
        wire.decode(msgspec.msgpack.encode(raw))


def test_lora_load_messages_round_trip() -> None:
    lora = LoRARequest("chat", 2, "/adapters/chat")
    added = wire.decode(wire.encode_add_lora(lora))
    assert added.kind is MessageType.ADD_LORA and added.lora == lora
    ok = wire.decode(wire.encode_lora_added(2, None))
    assert ok.kind is MessageType.LORA_ADDED and ok.count == 2 and ok.text is None
    failed = wire.decode(wire.encode_lora_added(2, "LoRA adapter /adapters/chat: no adapter_config.json"))
    assert failed.count == 2 and failed.text == "LoRA adapter /adapters/chat: no adapter_config.json"
    with pytest.raises(WireError, match="names no adapter"):
        wire.decode(msgspec.msgpack.encode([MessageType.ADD_LORA, None]))
    with pytest.raises(WireError, match="not an error message"):
        wire.decode(msgspec.msgpack.encode([MessageType.LORA_ADDED, 2, 7]))


def test_outputs_round_trip_with_logprobs_and_stats() -> None:
    outputs = [
        EngineCoreOutput(
            req_id=RequestId("a"),
            new_token_ids=[5, 6],
            finish_reason=None,
            logprobs=[{5: Logprob(-0.1, 1), 9: Logprob(-2.5, 2)}, {6: Logprob(-0.3, 1)}],
            prompt_logprobs=[{1: Logprob(-4.0, None)}],
            num_cached_tokens=16,
        ),
        EngineCoreOutput(RequestId("b"), [], "abort"),
        EngineCoreOutput(RequestId("c"), [2], "stop", stop_token_id=2),
        EngineCoreOutput(RequestId("d"), [], "stop", pooled=[0.25, -1.5, 3e-8]),
    ]
    stats = CoreStats(1, 2, 3, 64, 10, 100, 40)
    msg = wire.decode(wire.encode_outputs(outputs, stats))
    assert msg.outputs == outputs
    assert msg.stats == stats
    assert stats.kv_cache_usage == pytest.approx(10 / 64)


def test_pooling_request_round_trip() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    for pooling in (PoolingParams(), PoolingParams(pooling_type="MEAN", normalize=False)):
        req = EngineCoreRequest(RequestId("p"), [4, 5], params, frozenset({2}), pooling_params=pooling)
        assert wire.decode(wire.encode_add(req)).request == req
    raw = msgspec.msgpack.decode(wire.encode_add(req))
    raw[1][7]["pooling_type"] = "MAX"
    with pytest.raises(WireError, match="pooling_type"):
        wire.decode(msgspec.msgpack.encode(raw))


def test_control_messages_round_trip() -> None:
    ids = [RequestId("x"), RequestId("y#1")]
    assert wire.decode(wire.encode_ids(MessageType.ABORT, ids)).req_ids == ids
    assert wire.decode(wire.encode_ids(MessageType.FINISH, ids)).kind is MessageType.FINISH
    assert wire.decode(wire.encode_shutdown()).kind is MessageType.SHUTDOWN
    info = CoreInfo(512, 49152, frozenset({2}), 64, 16, "cpu_reference")
    assert wire.decode(wire.encode_ready(info)).info == info
    rejected = wire.decode(wire.encode_rejected(RequestId("z"), "too long"))
    assert rejected.req_ids == ["z"] and rejected.text == "too long"
    assert wire.decode(wire.encode_failed("boom")).text == "boom"
    with pytest.raises(ValueError, match="ABORT or FINISH"):
        wire.encode_ids(MessageType.ADD, ids)


def test_data_parallel_messages_round_trip() -> None:
    reqs = [
        EngineCoreRequest(RequestId("r#0"), [1, 2], SamplingParams(n=2, seed=5), frozenset({2})),
        EngineCoreRequest(
            RequestId("r#1"), [1, 2], SamplingParams(n=2, seed=5), frozenset({2}), RequestId("r#0")
        ),
    ]
    batch = wire.decode(wire.encode_add_many(reqs))
    assert batch.kind is MessageType.ADD_MANY and batch.requests == reqs
    assert wire.decode(wire.encode_reset_prefix_cache()).kind is MessageType.RESET_PREFIX_CACHE
    reset = wire.decode(wire.encode_prefix_cache_reset(12))
    assert reset.kind is MessageType.PREFIX_CACHE_RESET and reset.count == 12
    # Two replicas' snapshots read as one engine's; their common info is the tighter one.
    total = CoreStats.total([CoreStats(1, 2, 3, 64, 10, 100, 40), CoreStats(4, 0, 1, 32, 6, 50, 10)])
    assert total == CoreStats(5, 2, 4, 96, 16, 150, 50)
    infos = [
        CoreInfo(512, 49152, frozenset({2}), 64, 16, "triton"),
        CoreInfo(256, 49152, frozenset({2}), 80, 16, "triton"),
    ]
    assert CoreInfo.common(infos) == CoreInfo(256, 49152, frozenset({2}), 64, 16, "triton")


@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # not msgpack
        msgspec.msgpack.encode([99]),  # unknown message type
        msgspec.msgpack.encode([MessageType.ADD]),  # missing payload
        msgspec.msgpack.encode(
            [MessageType.OUTPUTS, [["a", [], "exploded", None, None, None, 0, None]], [0] * 7]
        ),
    ],
)
def test_malformed_messages_raise_wire_error(raw: bytes) -> None:
    with pytest.raises(WireError):
        wire.decode(raw)


def test_invalid_sampling_params_on_the_wire_are_refused() -> None:
    good = wire.encode_add(EngineCoreRequest(RequestId("r"), [1], SamplingParams(), frozenset()))
    raw = msgspec.msgpack.decode(good)
    raw[1][2]["temperature"] = -1.0
    with pytest.raises(WireError, match="temperature"):
        wire.decode(msgspec.msgpack.encode(raw))
