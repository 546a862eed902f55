"""What the offline front end (`LLMEngine`) drives: its engine core or cores, behind one contract.

One replica runs in this process (`InProcessCore`, the engine core itself); `data_parallel_size`
replicas run as processes or Ray actors (`processes.data_parallel.offline_client`). The front end
tokenizes, detokenizes and matches stop strings the same way over either, so a replica count is a
choice of client, not a second front end. A client carries sequences (`EngineCoreRequest`s) in
and their `EngineCoreOutput`s out; it never sees a `RequestOutput`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from transformers import PreTrainedTokenizerBase

from pagedserve.engine.protocol import EngineCoreOutput, EngineCoreRequest
from pagedserve.engine.setup import EngineSetup
from pagedserve.types import RequestId
from pagedserve.worker.step_runner import RankExecutor


@dataclass(frozen=True, slots=True)
class Rejection:
    """A sequence a replica refused after it was sent (the in-process core refuses at once)."""

    req_id: RequestId
    reason: str  # the core's words, with the replica that said them


@dataclass(frozen=True, slots=True)
class CoreStep:
    """What one `CoreClient.step` brought back."""

    outputs: list[EngineCoreOutput]  # what the step(s) did to each sequence, in arrival order
    rejected: Sequence[Rejection] = ()  # sequences refused since the last step; the client forgot them


class CoreClient(Protocol):
    """The engine core(s) behind a front end. Not thread-safe; every method but the getters
    mutates."""

    tokenizer: PreTrainedTokenizerBase | None  # None with skip_tokenizer_init
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int  # the smallest of every replica's

    @property
    def platform_name(self) -> str: ...

    def add_request(self, samples: Sequence[EngineCoreRequest]) -> None:
        """Queue the sequences of one request (its samples, or the one of a pooling request), all
        on the same core. Raises ValueError naming the problem when they can never run; then
        none of them is queued."""
        ...

    def abort(self, seq_ids: Sequence[RequestId]) -> None:
        """Abort sequences (unknown ids are ignored); their cores free them."""
        ...

    def finish(self, seq_ids: Sequence[RequestId]) -> None:
        """Stop sequences the front end finished itself (a stop string matched)."""
        ...

    def step(self) -> CoreStep:
        """Advance the cores and return what they reported: the in-process core steps once; a
        data-parallel client waits until any replica reports."""
        ...

    def drain(self) -> None:
        """Called when the front end tracks no request any more: finish what the cores still
        hold for requests it forgot (a launched step whose output is owed, reported aborts),
        so that an idle front end leaves idle cores. Outputs are dropped."""
        ...

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes of the blocks no request holds, on every core;
        returns how many blocks were forgotten in all."""
        ...

    def scheduler_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences over every core, as of its latest step."""
        ...

    def shutdown(self) -> None:
        """Stop what this client started. Idempotent."""
        ...


class InProcessCore:
    """One replica in this process: the engine core `build_engine` made, called directly."""

    def __init__(self, setup: EngineSetup) -> None:
        self.setup = setup
        self.core = setup.core
        self.tokenizer = setup.tokenizer
        self.vocab_size = setup.spec.vocab_size
        self.eos_token_ids = setup.eos_token_ids
        self.max_model_len = setup.max_model_len

    @property
    def platform_name(self) -> str:
        return self.setup.platform.name

    def add_request(self, samples: Sequence[EngineCoreRequest]) -> None:
        try:
            for sample in samples:
                self.core.add_request(sample)
        except ValueError:  # RequestRejected: drop the samples already queued
            self.core.abort([s.req_id for s in samples])
            raise

    def abort(self, seq_ids: Sequence[RequestId]) -> None:
        self.core.abort(seq_ids)

    def finish(self, seq_ids: Sequence[RequestId]) -> None:
        self.core.finish(seq_ids)

    def step(self) -> CoreStep:
        return CoreStep(self.core.step())

    def drain(self) -> None:
        core = self.core
        while core.has_unfinished_requests():
            core.step()

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def scheduler_counts(self) -> tuple[int, int]:
        scheduler = self.core.scheduler
        return len(scheduler.running), len(scheduler.waiting)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks, if the core drives any (else nothing to stop)."""
        if isinstance(self.core.runner, RankExecutor):
            self.core.runner.shutdown()
