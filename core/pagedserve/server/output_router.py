"""`OutputRouter`: a core's step outputs, turned into each request's `RequestOutput` or vector.

Runs on the event loop, in each core's reader task. A step's outputs are detokenized and checked
for stop strings (`OutputProcessor`) a slice of requests at a time, with the loop free between
slices (the engine's `OUTPUT_SLICE` says why not a thread); each request then finds its output
on its queue. Sequences a stop string ended here are finished in the core; a pooling request's
vector resolves its future; a request the core rejected fails with `InvalidRequest`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from pagedserve.engine.protocol import EngineCoreOutput
from pagedserve.outputs import PoolingOutput, PoolingRequestOutput
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import MessageType
from pagedserve.server.core_links import CoreLink
from pagedserve.server.engine_errors import InvalidRequest
from pagedserve.server.request_table import RequestTable


class OutputRouter:
    """Delivers the cores' outputs to the requests of `requests`. Every method mutates the table."""

    def __init__(self, requests: RequestTable, slice_size: int, stopped: Callable[[], bool]) -> None:
        self.requests = requests
        self.slice_size = slice_size  # the most requests applied before the event loop runs again
        self._stopped = stopped  # whether the engine died or shut down (every request was failed)

    async def route_outputs(self, link: CoreLink, outputs: list[EngineCoreOutput]) -> None:
        """Apply one step's outputs, `slice_size` requests at a time, letting the event loop run
        between slices."""
        for i, part in enumerate(self.slices(outputs)):
            if i:
                await asyncio.sleep(0)
                if self._stopped():
                    return  # every request was failed meanwhile: nothing is left to deliver
            self.apply_outputs(link, part)

    def slices(self, outputs: list[EngineCoreOutput]) -> list[list[EngineCoreOutput]]:
        """One step's outputs cut into lists of at most `slice_size` requests each, every
        request's samples in one list (so a request still gets one `RequestOutput` per step), the
        requests in the order of their first output. Does not mutate."""
        size = self.slice_size
        if len(outputs) <= size:
            return [outputs]
        owners = self.requests.seq_owner
        if len(owners) == len(self.requests.seqs):  # one sample each: one output per request
            return [outputs[i : i + size] for i in range(0, len(outputs), size)]
        by_request: dict[str, list[EngineCoreOutput]] = {}
        for out in outputs:
            by_request.setdefault(owners.get(out.req_id, out.req_id), []).append(out)
        groups = list(by_request.values())
        return [[out for group in groups[i : i + size] for out in group] for i in range(0, len(groups), size)]

    def apply_outputs(self, link: CoreLink, outputs: list[EngineCoreOutput]) -> None:
        """Detokenize and match stop strings for some requests' outputs of one step, and hand each
        request its `RequestOutput`."""
        requests = self.requests
        assert requests.processor is not None
        balancer = requests.balancer
        for out in outputs:
            balancer.on_output(out.req_id, len(out.new_token_ids), out.finish_reason is not None)
        if requests.pooling:
            outputs = self._deliver_pooled(outputs)
        results, to_stop = requests.processor.process(outputs)
        if to_stop:  # stop strings matched here: the core must stop computing them
            link.to_core.send(wire.encode_ids(MessageType.FINISH, to_stop))
            for seq_id in to_stop:  # a sequence finished this way is not reported back
                balancer.forget(seq_id)
        queues = requests.queues
        for result in results:
            requests.metrics.on_output(result)
            queue = queues.get(result.request_id)
            if queue is None:
                continue
            queue.put_nowait(result)
            if result.finished:
                del queues[result.request_id]
                requests.forget_sequences(result.request_id)

    def _deliver_pooled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand each pooling request that finished in `outputs` its vector; return the other
        requests' outputs."""
        requests = self.requests
        rest: list[EngineCoreOutput] = []
        for out in outputs:
            request_id = requests.seq_owner.get(out.req_id)
            waiting = requests.pooling.get(request_id) if request_id is not None else None
            if request_id is None or waiting is None:
                rest.append(out)
                continue
            if out.finish_reason is None:
                continue  # a chunk of its prompt was computed
            if out.pooled is None:  # the core ended it without a vector
                error = RuntimeError(f"the engine core aborted pooling request {request_id}")
                requests.fail(request_id, error)
                continue
            del requests.pooling[request_id]
            requests.forget_sequences(request_id)
            requests.metrics.on_pooled(request_id)
            future, ids = waiting
            if not future.done():
                vector = torch.tensor(out.pooled, dtype=torch.float32)
                future.set_result(PoolingRequestOutput(request_id, PoolingOutput(vector), ids, True))
        return rest

    def rejected(self, link: CoreLink, msg: wire.Message) -> None:
        """A REJECTED message: the core refused a request's sequence, so the request fails."""
        assert msg.req_ids is not None
        requests = self.requests
        requests.balancer.forget(msg.req_ids[0])
        request_id = requests.seq_owner.get(msg.req_ids[0])
        if request_id is None:
            return
        # Its other samples may have been admitted (or wait on the rejected one): drop them.
        link.to_core.send(wire.encode_ids(MessageType.ABORT, requests.seqs.get(request_id, [])))
        requests.fail(request_id, InvalidRequest(msg.text or "the engine rejected the request"))
