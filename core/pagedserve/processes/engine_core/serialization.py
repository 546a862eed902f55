"""The wire format between the API server process and the engine-core process.

Every message is one msgpack array `[MessageType, ...payload]` of builtins, encoded with msgspec.
The protocol dataclasses are converted field by field here, explicitly: nothing is pickled, so a
message can never run code on decode, and a field added to a dataclass fails loudly in
`encode_*` until it is given a wire form.

    API -> core:  [ADD, request]  [ADD_MANY, [request...]]  [ABORT, [seq ids]]  [FINISH, [seq ids]]
                  [RESET_PREFIX_CACHE]  [ADD_LORA, lora]  [SHUTDOWN]
    core -> API:  [READY, CoreInfo]  [OUTPUTS, [output...], CoreStats]  [REJECTED, seq id, message]
                  [PREFIX_CACHE_RESET, blocks forgotten]  [LORA_ADDED, lora_int_id, error or None]
                  [FAILED, message]

ADD_MANY hands a whole batch to the core in one message, so that an offline front end's batch is
scheduled as a whole (the core never starts stepping on the first few requests of it). A request's
LoRA adapter, and ADD_LORA's, travel as `[lora_name, lora_int_id, lora_path]` (None: the base
model). ADD_LORA has the core read and check an adapter now (the server's `--lora-modules`, at
start-up); LORA_ADDED answers it, with the problem when the adapter cannot be served.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec

from pagedserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, TokenLogprobs
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import FinishReason, Logprob
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import SchedulerStats
from pagedserve.spec_decode.metrics import SpecDecodeCounts
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.types import RequestId

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()
_FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort"})


class MessageType(enum.IntEnum):
    ADD = 1
    ABORT = 2
    FINISH = 3
    SHUTDOWN = 4
    ADD_MANY = 5
    RESET_PREFIX_CACHE = 6
    ADD_LORA = 7
    READY = 10
    OUTPUTS = 11
    REJECTED = 12
    FAILED = 13
    PREFIX_CACHE_RESET = 14
    LORA_ADDED = 15


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the API process needs to know about the model the core loaded."""

    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    num_kv_blocks: int
    block_size: int
    platform: str

    @classmethod
    def common(cls, infos: list[CoreInfo]) -> CoreInfo:
        """What a front end may assume of every one of several cores (data-parallel replicas of
        one model, each of which sized its KV cache from its own free memory): the first's
        model facts, the shortest context and the smallest cache."""
        return dataclasses.replace(
            infos[0],
            max_model_len=min(i.max_model_len for i in infos),
            num_kv_blocks=min(i.num_kv_blocks for i in infos),
        )


@dataclass(frozen=True, slots=True)
class CoreStats:
    """A snapshot of the scheduler after a step, for /metrics. Counters are totals since start."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    num_kv_blocks: int
    num_kv_blocks_in_use: int
    prefix_queries_tokens: int
    prefix_hits_tokens: int
    # Speculative decoding since start (zeros without a proposer): see `spec_decode.metrics`.
    spec_decode: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)

    @classmethod
    def idle(cls, num_kv_blocks: int) -> CoreStats:
        """A core that has not stepped yet: nothing running, every block free."""
        return cls(0, 0, 0, num_kv_blocks, 0, 0, 0)

    @classmethod
    def from_scheduler(cls, stats: SchedulerStats, spec_decode: SpecDecodeCounts | None = None) -> CoreStats:
        kv = stats.kv_cache
        return cls(
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_preemptions=stats.num_preemptions,
            num_kv_blocks=kv.num_blocks,
            num_kv_blocks_in_use=kv.num_blocks_in_use,
            prefix_queries_tokens=kv.counters.prefix_queries_tokens,
            prefix_hits_tokens=kv.counters.prefix_hits_tokens,
            spec_decode=spec_decode or SpecDecodeCounts(),
        )

    @classmethod
    def total(cls, snapshots: list[CoreStats]) -> CoreStats:
        """The sum of several cores' snapshots (data-parallel replicas): one engine to /metrics."""
        counts = [f.name for f in dataclasses.fields(cls) if f.name != "spec_decode"]
        sums = {name: sum(getattr(s, name) for s in snapshots) for name in counts}
        sums["spec_decode"] = sum((s.spec_decode for s in snapshots), SpecDecodeCounts())
        return cls(**sums)

    def to_wire(self) -> list[Any]:
        """The snapshot as the OUTPUTS message carries it (positional). Pure."""
        fields = [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "spec_decode"]
        spec = self.spec_decode
        return [
            *fields,
            [spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(spec.accepted_per_pos)],
        ]

    @classmethod
    def from_wire(cls, raw: list[Any]) -> CoreStats:
        """The inverse of `to_wire`. Raises TypeError or ValueError on a malformed list."""
        *fields, spec = raw
        drafts, tokens, accepted, per_pos = spec
        counts = SpecDecodeCounts(drafts, tokens, accepted, tuple(per_pos))
        return dataclasses.replace(cls(*fields), spec_decode=counts)

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_in_use / self.num_kv_blocks if self.num_kv_blocks else 0.0


class WireError(ValueError):
    """A message that does not follow the wire format (a bug or a version mismatch)."""


# ---- building blocks ------------------------------------------------------------------------------


def _params_to_wire(params: SamplingParams) -> dict[str, Any]:
    wire: dict[str, Any] = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, tuple):
            value = list(value)
        elif f.name == "logit_bias" and value is not None:
            value = dict(value)
        elif f.name == "structured_outputs" and value is not None:
            value = value.to_wire()
        wire[f.name] = value
    return wire


def _params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    # SamplingParams validates again: a malformed message fails here, naming the field.
    structured = wire.get("structured_outputs")
    if structured is not None:
        wire = {**wire, "structured_outputs": StructuredOutputsParams.from_wire(structured)}
    return SamplingParams(**wire)


def _logprobs_to_wire(entries: list[TokenLogprobs] | None) -> list[list[list[Any]]] | None:
    if entries is None:
        return None
    # token id -> Logprob becomes [token id, logprob, rank] triples; decoded_token is always None
    # here (the core has no tokenizer).
    return [[[t, lp.logprob, lp.rank] for t, lp in entry.items()] for entry in entries]


def _logprobs_from_wire(wire: list[list[list[Any]]] | None) -> list[TokenLogprobs] | None:
    if wire is None:
        return None
    return [{int(t): Logprob(float(lp), rank) for t, lp, rank in entry} for entry in wire]


def _lora_to_wire(lora: LoRARequest | None) -> list[Any] | None:
    if lora is None:
        return None
    return [lora.lora_name, lora.lora_int_id, lora.lora_path]


def _lora_from_wire(wire: list[Any] | None) -> LoRARequest | None:
    if wire is None:
        return None
    name, lora_int_id, path = wire
    # LoRARequest validates again: a malformed message fails here, naming the field.
    return LoRARequest(name, lora_int_id, path)


def _request_to_wire(req: EngineCoreRequest) -> list[Any]:
    return [
        req.req_id,
        req.prompt_token_ids,
        _params_to_wire(req.sampling_params),
        sorted(req.eos_token_ids),
        req.fork_of,
        req.cache_salt,
        req.priority,
        _pooling_to_wire(req.pooling_params),
        _lora_to_wire(req.lora_request),
    ]


def _request_from_wire(wire: list[Any]) -> EngineCoreRequest:
    req_id, prompt, params, eos, fork_of, cache_salt, priority, pooling, lora = wire
    return EngineCoreRequest(
        req_id=RequestId(req_id),
        prompt_token_ids=list(prompt),
        sampling_params=_params_from_wire(params),
        eos_token_ids=frozenset(eos),
        fork_of=RequestId(fork_of) if fork_of is not None else None,
        cache_salt=cache_salt,
        priority=priority,
        pooling_params=_pooling_from_wire(pooling),
        lora_request=_lora_from_wire(lora),
    )


def _pooling_to_wire(params: PoolingParams | None) -> dict[str, Any] | None:
    if params is None:
        return None
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def _pooling_from_wire(wire: dict[str, Any] | None) -> PoolingParams | None:
    # PoolingParams validates again: a malformed message fails here, naming the field.
    return PoolingParams(**wire) if wire is not None else None


def _output_to_wire(out: EngineCoreOutput) -> list[Any]:
    return [
        out.req_id,
        out.new_token_ids,
        out.finish_reason,
        out.stop_token_id,
        _logprobs_to_wire(out.logprobs),
        _logprobs_to_wire(out.prompt_logprobs),
        out.num_cached_tokens,
        out.pooled,
    ]


def _output_from_wire(wire: list[Any]) -> EngineCoreOutput:
    req_id, new_ids, finish, stop_id, logprobs, prompt_logprobs, cached, pooled = wire
    if finish is not None and finish not in _FINISH_REASONS:
        raise WireError(f"unknown finish reason {finish!r}")
    return EngineCoreOutput(
        req_id=RequestId(req_id),
        new_token_ids=list(new_ids),
        finish_reason=cast("FinishReason | None", finish),
        stop_token_id=stop_id,
        logprobs=_logprobs_from_wire(logprobs),
        prompt_logprobs=_logprobs_from_wire(prompt_logprobs),
        num_cached_tokens=cached,
        pooled=[float(x) for x in pooled] if pooled is not None else None,
    )


def _info_to_wire(info: CoreInfo) -> dict[str, Any]:
    wire = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    wire["eos_token_ids"] = sorted(info.eos_token_ids)
    return wire


# ---- messages -------------------------------------------------------------------------------------


def encode_add(req: EngineCoreRequest) -> bytes:
    return _ENCODER.encode([MessageType.ADD, _request_to_wire(req)])


def encode_add_many(reqs: list[EngineCoreRequest]) -> bytes:
    return _ENCODER.encode([MessageType.ADD_MANY, [_request_to_wire(r) for r in reqs]])


def encode_ids(kind: MessageType, req_ids: list[RequestId]) -> bytes:
    """An ABORT or FINISH message."""
    if kind not in (MessageType.ABORT, MessageType.FINISH):
        raise ValueError(f"encode_ids makes ABORT or FINISH messages, not {kind.name}")
    return _ENCODER.encode([kind, list(req_ids)])


def encode_shutdown() -> bytes:
    return _ENCODER.encode([MessageType.SHUTDOWN])


def encode_reset_prefix_cache() -> bytes:
    return _ENCODER.encode([MessageType.RESET_PREFIX_CACHE])


def encode_prefix_cache_reset(num_blocks: int) -> bytes:
    return _ENCODER.encode([MessageType.PREFIX_CACHE_RESET, num_blocks])


def encode_add_lora(lora: LoRARequest) -> bytes:
    return _ENCODER.encode([MessageType.ADD_LORA, _lora_to_wire(lora)])


def encode_lora_added(lora_int_id: int, error: str | None) -> bytes:
    """The core's answer to ADD_LORA: `error` says why the adapter cannot be served (None: it can)."""
    return _ENCODER.encode([MessageType.LORA_ADDED, lora_int_id, error])


def encode_ready(info: CoreInfo) -> bytes:
    return _ENCODER.encode([MessageType.READY, _info_to_wire(info)])


def encode_outputs(outputs: list[EngineCoreOutput], stats: CoreStats) -> bytes:
    return _ENCODER.encode([MessageType.OUTPUTS, [_output_to_wire(o) for o in outputs], stats.to_wire()])


def encode_rejected(req_id: RequestId, message: str) -> bytes:
    return _ENCODER.encode([MessageType.REJECTED, req_id, message])


def encode_failed(message: str) -> bytes:
    return _ENCODER.encode([MessageType.FAILED, message])


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded message; which fields are set depends on `kind` (see the module docstring)."""

    kind: MessageType
    request: EngineCoreRequest | None = None  # ADD
    requests: list[EngineCoreRequest] | None = None  # ADD_MANY
    req_ids: list[RequestId] | None = None  # ABORT, FINISH; REJECTED (one id)
    outputs: list[EngineCoreOutput] | None = None  # OUTPUTS
    stats: CoreStats | None = None  # OUTPUTS
    info: CoreInfo | None = None  # READY
    text: str | None = None  # REJECTED, FAILED, LORA_ADDED (None: loaded): what went wrong
    # PREFIX_CACHE_RESET: blocks whose cached prefix was forgotten; LORA_ADDED: the adapter's id
    count: int | None = None
    lora: LoRARequest | None = None  # ADD_LORA


def decode(data: bytes) -> Message:
    """Decode one message. Raises WireError when it is malformed."""
    try:
        raw = _DECODER.decode(data)
        kind = MessageType(raw[0])
        if kind is MessageType.ADD:
            return Message(kind, request=_request_from_wire(raw[1]))
        if kind is MessageType.ADD_MANY:
            return Message(kind, requests=[_request_from_wire(r) for r in raw[1]])
        if kind in (MessageType.ABORT, MessageType.FINISH):
            return Message(kind, req_ids=[RequestId(r) for r in raw[1]])
        if kind in (MessageType.SHUTDOWN, MessageType.RESET_PREFIX_CACHE):
            return Message(kind)
        if kind is MessageType.PREFIX_CACHE_RESET:
            return Message(kind, count=int(raw[1]))
        if kind is MessageType.ADD_LORA:
            if raw[1] is None:
                raise WireError("ADD_LORA names no adapter")
            return Message(kind, lora=_lora_from_wire(raw[1]))
        if kind is MessageType.LORA_ADDED:
            error = raw[2]
            if error is not None and not isinstance(error, str):
                raise WireError(f"LORA_ADDED carries a {type(error).__name__}, not an error message")
            return Message(kind, count=int(raw[1]), text=error)
        if kind is MessageType.READY:
            wire = dict(raw[1])
            wire["eos_token_ids"] = frozenset(wire["eos_token_ids"])
            return Message(kind, info=CoreInfo(**wire))
        if kind is MessageType.OUTPUTS:
            return Message(
                kind, outputs=[_output_from_wire(o) for o in raw[1]], stats=CoreStats.from_wire(raw[2])
            )
        if kind is MessageType.REJECTED:
            return Message(kind, req_ids=[RequestId(raw[1])], text=raw[2])
        return Message(kind, text=raw[1])
    except WireError:
        raise
    except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise WireError(f"malformed engine message: {type(exc).__name__}: {exc}") from None
