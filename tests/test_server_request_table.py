"""The async engine's request table and output router, without processes: a request's samples go
to one replica and come back as one output per step, slices keep a request's samples together,
and aborting or failing a request reaches its consumer and (only when told to) its core."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineCoreOutput
from pagedserve.outputs import RequestOutput
from pagedserve.processes.data_parallel.balancer import LoadBalancer
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import CoreInfo, MessageType
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.core_links import CoreLink
from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.output_router import OutputRouter
from pagedserve.server.request_table import RequestTable

INFO = CoreInfo(
    max_model_len=64,
    vocab_size=32,
    eos_token_ids=frozenset({2}),
    num_kv_blocks=8,
    block_size=16,
    platform="cpu",
)
PARAMS = SamplingParams(max_tokens=4, detokenize=False, ignore_eos=True)
TWO = SamplingParams(n=2, max_tokens=4, detokenize=False)


class Sink:
    """A core's PUSH socket: records the decoded messages sent to it."""

    def __init__(self) -> None:
        self.sent: list[wire.Message] = []

    def send(self, data: bytes) -> None:
        self.sent.append(wire.decode(data))

    def kinds(self) -> list[MessageType]:
        return [m.kind for m in self.sent]


def _table(replicas: int = 2, slice_size: int = 16) -> tuple[RequestTable, OutputRouter, list[Sink]]:
    sinks = [Sink() for _ in range(replicas)]
    table = RequestTable(sinks, LoadBalancer(replicas), ServerMetrics(lambda: None))  # type: ignore[arg-type]
    table.processor = OutputProcessor(None, eos_token_id=2, max_model_len=INFO.max_model_len)
    return table, OutputRouter(table, slice_size, lambda: False), sinks


def _link(sink: Sink) -> CoreLink:
    return CoreLink(0, sink, None, several=False)  # type: ignore[arg-type]


def _drain(queue: asyncio.Queue[RequestOutput | BaseException]) -> list[RequestOutput | BaseException]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_a_requests_samples_go_to_one_replica_and_return_as_one_output_per_step() -> None:
    table, router, sinks = _table()
    queue = table.add(
        "hi", [5, 6], SamplingParams(n=2, max_tokens=4, detokenize=False), "r", INFO, False, None
    )
    (replica,) = (i for i, s in enumerate(sinks) if s.sent)
    adds = sinks[replica].sent
    assert [m.kind for m in adds] == [MessageType.ADD, MessageType.ADD]
    seq_ids = table.seqs["r"]
    assert [m.request.req_id for m in adds if m.request] == seq_ids
    assert adds[1].request is not None and adds[1].request.fork_of == seq_ids[0]  # shares the prompt
    router.apply_outputs(_link(sinks[replica]), [EngineCoreOutput(s, [7], None) for s in seq_ids])
    (step,) = _drain(queue)
    assert isinstance(step, RequestOutput) and [o.token_ids for o in step.outputs] == [[7], [7]]
    router.apply_outputs(_link(sinks[replica]), [EngineCoreOutput(s, [8], "length") for s in seq_ids])
    (last,) = _drain(queue)
    assert isinstance(last, RequestOutput) and last.finished
    assert table.in_flight() == [] and table.seq_owner == {}  # forgotten once finished


def test_slices_keep_a_requests_samples_together() -> None:
    table, router, _ = _table(replicas=1, slice_size=2)
    for name, n in (("a", 1), ("b", 2), ("c", 1), ("d", 1)):
        table.add("hi", [5], SamplingParams(n=n, max_tokens=4, detokenize=False), name, INFO, False, None)
    outputs = [EngineCoreOutput(s, [7], None) for name in "abcd" for s in table.seqs[name]]
    slices = router.slices(outputs)
    owners = [[table.seq_owner[o.req_id] for o in part] for part in slices]
    assert owners == [["a", "b", "b"], ["c", "d"]]  # two requests a slice, b's samples together


def test_abort_reaches_the_consumer_and_the_core_only_when_it_can_be_sent() -> None:
    table, _, sinks = _table(replicas=1)
    queue = table.add("hi", [5], PARAMS, "r", INFO, False, None)
    seq_ids = list(table.seqs["r"])
    table.abort("r", "test", send=True)
    assert sinks[0].kinds()[-1] is MessageType.ABORT and sinks[0].sent[-1].req_ids == seq_ids
    (final,) = _drain(queue)
    assert isinstance(final, RequestOutput) and final.outputs[0].finish_reason == "abort"
    queue = table.add("hi", [5], PARAMS, "s", INFO, False, None)
    table.abort("s", "test", send=False)  # the cores are gone or going: nothing is sent
    assert sinks[0].kinds()[-1] is MessageType.ADD and table.in_flight() == []
    table.abort("unknown", "test", send=True)  # ignored
    table.add("hi", [5], PARAMS, "t", INFO, False, None)
    with pytest.raises(InvalidRequest, match="already in use"):
        table.add("hi", [5], PARAMS, "t", INFO, False, None)


def test_failing_every_request_ends_each_stream_with_the_error() -> None:
    table, _, sinks = _table(replicas=1)
    queues = [table.add("hi", [5], PARAMS, name, INFO, False, None) for name in ("a", "b")]
    assert table.fail_all("gone", abort_in_core=True) == 2
    for queue in queues:
        (error,) = _drain(queue)
        assert isinstance(error, EngineDeadError) and str(error) == "gone"
    assert sinks[0].kinds().count(MessageType.ABORT) == 2
    assert table.in_flight() == [] and table.seqs == {} and table.replica_of == {}


def test_a_rejected_sequence_fails_its_request_and_drops_its_other_samples() -> None:
    table, router, sinks = _table(replicas=1)
    queue = table.add("hi", [5], TWO, "r", INFO, False, None)
    seq_ids = list(table.seqs["r"])
    rejected = wire.Message(MessageType.REJECTED, req_ids=[seq_ids[0]], text="too long for the cache")
    router.rejected(_link(sinks[0]), rejected)
    assert sinks[0].sent[-1].kind is MessageType.ABORT and sinks[0].sent[-1].req_ids == seq_ids
    (error,) = _drain(queue)
    assert isinstance(error, InvalidRequest) and "too long" in str(error)
