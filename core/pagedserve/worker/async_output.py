"""A step's sampled tokens on their way to the host: a pinned copy behind an event, read later.

`ModelRunner.launch` returns a `PendingOutput` as soon as the step's work is queued on the device.
The sampled token ids stay on the device (the next step reads its placeholder inputs from there)
and are copied to pinned host memory on a side stream, followed by an event; `result()` waits for
that event only, so the host can schedule and launch the next step first (asynchronous
scheduling), and never stalls on a blocking `.tolist()` of a tensor still being computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.outputs import Logprob
from pagedserve.sampling.logprobs import LogprobsTensors, logprobs_to_dicts
from pagedserve.types import RequestId

TokenLogprobs = dict[int, Logprob]  # token id -> logprob, for one position


@dataclass(frozen=True, slots=True)
class ModelRunnerOutput:
    """What one step produced. Requests in the middle of a chunked prefill sample nothing."""

    # req_id -> sampled tokens: one, or accepted drafts plus one when drafts were scored
    sampled: dict[RequestId, list[int]]
    # req_id -> one dict per sampled token; only requests whose params asked for logprobs
    logprobs: dict[RequestId, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> logprobs of prompt tokens 1..P-1, once the whole prompt has been computed
    prompt_logprobs: dict[RequestId, list[TokenLogprobs]] = field(default_factory=dict)
    # req_id -> pooled vector [hidden_size] (float32), once a pooling request's whole prompt has
    # been computed; such a request samples nothing
    pooled: dict[RequestId, list[float]] = field(default_factory=dict)


class HostCopy:
    """Device tensors copied to the host without blocking it. With a CUDA `side` stream: into
    pinned buffers on that stream, after it waited for the work queued so far, then an event (the
    next step's kernels on the main stream do not queue behind the copy). Without one the copy is
    made when the tensors are read (on the CPU they already are host tensors)."""

    def __init__(self, tensors: list[torch.Tensor], side: torch.cuda.Stream | None) -> None:
        self._event: torch.cuda.Event | None = None
        if not tensors or side is None:
            self._host = tensors
            return
        side.wait_stream(torch.cuda.current_stream(tensors[0].device))
        with torch.cuda.stream(side):
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, dev in zip(self._host, tensors, strict=True):
                host.copy_(dev, non_blocking=True)
                dev.record_stream(side)  # the allocator must not reuse it before the copy ran
            self._event = torch.cuda.Event()
            self._event.record(side)

    def done(self) -> bool:
        """Whether `wait` would return at once. Does not mutate."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> list[torch.Tensor]:
        """The host copies, once the device has written them (blocks until then)."""
        if self._event is not None:
            self._event.synchronize()
            return self._host
        return [t.cpu() for t in self._host]


@dataclass(frozen=True, slots=True)
class LogprobRequests:
    """Which sampled positions' logprobs go to which request."""

    tensors: LogprobsTensors  # on the device; one row per sampled position
    num_logprobs: list[int]  # [num_positions] top-N wanted at each position (0: none)
    wanted: list[tuple[RequestId, int]]  # (req_id, index of its first sampled position)


class PendingOutput:
    """One launched step's output. The device keeps `token_ids` (the next step's placeholder
    inputs read them); `result()` reads the host copy once and caches the `ModelRunnerOutput`."""

    def __init__(
        self,
        req_ids: list[RequestId],
        drafts: dict[RequestId, list[int]],
        token_ids: torch.Tensor | None,
        *,
        first_position: np.ndarray,
        copy_stream: torch.cuda.Stream | None = None,
        logprobs: LogprobRequests | None = None,
        prompt_logprobs: dict[RequestId, list[TokenLogprobs]] | None = None,
        pooled: dict[RequestId, torch.Tensor] | None = None,  # req_id -> [hidden_size] on the device
    ) -> None:
        # req_ids: the requests that sampled, in position order; first_position[k]: index in
        # token_ids of req_ids[k]'s first sampled position; token_ids: [num_positions] on the
        # device; copy_stream: the CUDA stream of the host copy (None: copied when read)
        self.req_ids = req_ids
        self.drafts = drafts
        self.token_ids = token_ids
        self.first_position = first_position
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs or {}
        self._pooled = pooled or {}
        copied: list[torch.Tensor] = [] if token_ids is None else [token_ids]
        if logprobs is not None:
            t = logprobs.tensors
            copied += [t.token_ids, t.logprobs, t.ranks]
        self._copy = HostCopy(copied, copy_stream)
        self._result: ModelRunnerOutput | None = None
        self._host_tokens: list[int] | None = None
        self._position_of: dict[RequestId, int] | None = None

    def positions_of(self, req_ids: list[RequestId]) -> np.ndarray:
        """[len(req_ids)] index in `token_ids` of each request's sampled token. Raises
        RuntimeError naming a request that sampled nothing or scored drafts (its next input is
        not one known position). Mutates a cache only."""
        position_of = self._position_of
        if position_of is None:
            position_of = self._position_of = {
                req_id: first
                for req_id, first in zip(self.req_ids, self.first_position.tolist(), strict=True)
                if req_id not in self.drafts
            }
        try:
            return np.fromiter(map(position_of.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        except KeyError as exc:
            raise RuntimeError(
                f"request {exc.args[0]!r} was scheduled on an output the previous step did not sample "
                "(or sampled after drafts): scheduling ahead needs exactly one sampled token"
            ) from None

    def done(self) -> bool:
        """Whether the device has finished the step (its copies included). Does not mutate."""
        return self._result is not None or self._copy.done()

    def host_tokens(self) -> list[int]:
        """Every sampled position's token id, in order; waits for the device. Mutates the cache."""
        if self._host_tokens is None:
            copies = self._copy.wait()
            self._host_tokens = copies[0].tolist() if self.token_ids is not None else []
        return self._host_tokens

    def result(self) -> ModelRunnerOutput:
        """The step's output; waits for the device the first time. Mutates the cache only."""
        if self._result is None:
            self._result = self._build()
        return self._result

    def _build(self) -> ModelRunnerOutput:
        tokens = self.host_tokens()
        sampled = accept_drafts(self.req_ids, tokens, self.drafts)
        logprobs: dict[RequestId, list[TokenLogprobs]] = {}
        lp = self._logprobs
        if lp is not None:
            _, token_ids, values, ranks = self._copy.wait()
            dicts = logprobs_to_dicts(LogprobsTensors(token_ids, values, ranks), lp.num_logprobs)
            for req_id, start in lp.wanted:
                logprobs[req_id] = dicts[start : start + len(sampled[req_id])]
        # Pooled vectors are read here, with the step's other results: only steps that finish a
        # pooling request's prompt have any.
        pooled = {req_id: vector.cpu().tolist() for req_id, vector in self._pooled.items()}
        return ModelRunnerOutput(
            sampled=sampled, logprobs=logprobs, prompt_logprobs=self._prompt_logprobs, pooled=pooled
        )


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on `device` without blocking the host. On CUDA it goes through pinned
    memory with a non-blocking copy: a plain copy from pageable memory waits until the stream is
    idle, which would make the host wait for the step in flight."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def accept_drafts(
    req_ids: list[RequestId], tokens: list[int], drafts: dict[RequestId, list[int]]
) -> dict[RequestId, list[int]]:
    """req_id -> its accepted tokens, from the sampled tokens (each request's positions in
    order: one per draft, then one more). Does not mutate its arguments."""
    if not drafts:
        return {req_id: [token] for req_id, token in zip(req_ids, tokens, strict=True)}
    sampled: dict[RequestId, list[int]] = {}
    pos = 0
    for req_id in req_ids:
        draft = drafts.get(req_id, [])
        accepted: list[int] = []
        for j in range(len(draft) + 1):
            accepted.append(tokens[pos + j])
            # Sampling from the target and keeping the draft only when the sample equals it is
            # exact rejection sampling for deterministic (one-hot) drafts.
            if j < len(draft) and tokens[pos + j] != draft[j]:
                break
        sampled[req_id] = accepted
        pos += len(draft) + 1
    if pos != len(tokens):
        raise RuntimeError(f"sampled {len(tokens)} tokens for {pos} positions")
    return sampled
