"""The `mp` executor's step messages: one pickle for every rank, with the per-request NamedTuples of
a step sent as plain tuples and rebuilt as the same type."""

from __future__ import annotations

import pickle

from pagedserve.processes.tensor_parallel.multiproc import dumps_call
from pagedserve.scheduler.output import CachedRequestData


def test_step_message_round_trips_cached_requests() -> None:
    reqs = [
        tuple.__new__(CachedRequestData, (f"r{i}", [i], [7, 8], None if i else [1, 2], 30 + i))
        for i in range(3)
    ]
    method, args = pickle.loads(dumps_call("launch", (reqs, {"k": reqs[0]})))
    assert method == "launch"
    assert args == (reqs, {"k": reqs[0]})
    assert all(type(r) is CachedRequestData for r in args[0])
    assert args[0][1].new_block_ids == [7, 8] and args[0][0].replaced_block_ids == [1, 2]
