"""Placing requests on data-parallel replicas: each goes to the replica with the least queued work.

A replica's queued work is the sum, over the sequences placed on it and not finished, of the
tokens it still has to compute: prompt tokens not computed yet plus tokens still to generate (at
most `max_tokens`). Counting tokens rather than requests keeps one replica from collecting the
long prompts; counting `max_tokens` up front is an upper bound, corrected as tokens arrive and
dropped when a sequence finishes early. Ties go to the lowest replica index, so placement is
deterministic. Prefix-cache locality is not considered: a request whose prompt another replica
has cached may land elsewhere and compute it again.

Everything is tracked here, in the front end, from what the front end sends and receives; the
replicas are never asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.types import RequestId


@dataclass(slots=True)
class _Queued:
    """One unfinished sequence; mutated as its outputs arrive."""

    replica: int
    prompt_left: int  # prompt tokens not computed yet (0 for a fork: it shares its parent's)
    decode_left: int  # tokens it may still generate

    @property
    def work(self) -> int:
        return self.prompt_left + self.decode_left


class LoadBalancer:
    """The queued work of every replica and the replica of every unfinished sequence. Every
    method but the getters mutates; not thread-safe."""

    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self._load = [0] * num_replicas  # replica -> queued tokens; == sum of its sequences' work
        self._queued: dict[RequestId, _Queued] = {}  # sequence id -> its state
        self.placed = [0] * num_replicas  # replica -> requests placed on it since start

    @property
    def load(self) -> tuple[int, ...]:
        """Queued tokens per replica."""
        return tuple(self._load)

    def place(self, seq_ids: Sequence[RequestId], prompt_len: int, max_tokens: int) -> int:
        """Put the sequences of one request (its samples: forks of the first share its prompt, so
        they must share its replica) on the least loaded replica; returns that replica."""
        load = self._load
        replica = min(range(len(load)), key=load.__getitem__)  # the first of equals: lowest index
        for i, seq_id in enumerate(seq_ids):
            queued = _Queued(replica, prompt_len if i == 0 else 0, max_tokens)
            self._queued[seq_id] = queued
            load[replica] += queued.work
        self.placed[replica] += 1
        return replica

    def replica_of(self, seq_id: RequestId) -> int | None:
        """The replica of an unfinished sequence (None once finished or never placed)."""
        queued = self._queued.get(seq_id)
        return queued.replica if queued is not None else None

    def on_output(self, seq_id: RequestId, num_new_tokens: int, finished: bool) -> None:
        """Account for one core output of a sequence (unknown ids are ignored). A sampled token
        means the prompt is computed."""
        queued = self._queued.get(seq_id)
        if queued is None:
            return
        if finished:
            self.forget(seq_id)
            return
        if num_new_tokens:
            done = queued.prompt_left + min(num_new_tokens, queued.decode_left)
            queued.prompt_left = 0
            queued.decode_left -= min(num_new_tokens, queued.decode_left)
            self._load[queued.replica] -= done

    def forget(self, seq_id: RequestId) -> None:
        """Drop a sequence whose replica will not report it again (finished, stopped by the front
        end, rejected). Unknown ids are ignored."""
        queued = self._queued.pop(seq_id, None)
        if queued is not None:
            self._load[queued.replica] -= queued.work

    def has_unfinished(self) -> bool:
        return bool(self._queued)

    def unfinished_on(self, replica: int) -> int:
        """How many sequences on `replica` are unfinished. O(sequences)."""
        return sum(1 for q in self._queued.values() if q.replica == replica)
