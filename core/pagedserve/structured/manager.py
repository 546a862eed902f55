"""The engine core's side of structured outputs: grammars compiled in the background and cached by
key, one matcher per request, and the host bitmask of each step.

A request with a constraint is held back until its grammar is compiled (`poll`), so compiling
never blocks the requests already running. Each step, `bitmask` writes the allowed tokens of every
sampled position into one host tensor; the model runner calls it after launching the forward, so
the host work overlaps the device's. A request scoring draft tokens gets one row per position: the
matcher walks the drafts, filling each position's row, and rolls back; a position after a draft the
grammar refuses is left unconstrained, since the sampler's rejection of that draft discards it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from pagedserve.structured.backend import GrammarMatcher, StructuredOutputBackend, allocate_bitmask
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.types import RequestId

logger = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 256
"""Compiled grammars kept (least recently used dropped first)."""


@dataclass(frozen=True, slots=True)
class GrammarFailed:
    """A constraint that did not compile."""

    message: str


class StructuredOutputManager:
    """Owned by the engine core; single-threaded except for the compilation pool."""

    def __init__(
        self,
        make_backend: Callable[[], StructuredOutputBackend],
        *,
        max_rollback_tokens: int = 0,
        pin_memory: bool = False,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_workers: int = 2,
    ) -> None:
        self._make_backend = make_backend
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()  # the first compilations race to build the backend
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str, bool], Future[object]] = OrderedDict()
        self._cache_size = cache_size
        self._compiling: dict[RequestId, Future[object]] = {}  # req_id -> its grammar, until ready
        self._matchers: dict[RequestId, GrammarMatcher] = {}  # req_id -> its state
        self._max_rollback = max_rollback_tokens
        self._pin = pin_memory
        self._buffer: torch.Tensor | None = None  # [rows, words] int32 host bitmask, grown on demand

    # ---- compilation ---------------------------------------------------------------------------
    def backend(self) -> StructuredOutputBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def submit(self, req_id: RequestId, params: StructuredOutputsParams) -> None:
        """Start compiling (or reuse the cached compilation of) a request's constraint."""
        future = self._cache.get(params.key)
        if future is None:
            future = self._pool.submit(lambda: self.backend().compile(params))
            self._cache[params.key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(params.key)
        self._compiling[req_id] = future

    def poll(self, req_id: RequestId) -> bool | GrammarFailed:
        """True once the request's grammar is ready (its matcher then exists), False while it
        compiles, `GrammarFailed` if it cannot compile (the request must then be dropped)."""
        future = self._compiling.get(req_id)
        if future is None:
            return req_id in self._matchers
        if not future.done():
            return False
        del self._compiling[req_id]
        error = future.exception()
        if error is not None:
            return GrammarFailed(f"the structured-output constraint did not compile: {error}")
        self._matchers[req_id] = self.backend().new_matcher(future.result(), self._max_rollback)
        return True

    def wait_any(self, timeout: float) -> None:
        """Block until some compilation finishes or `timeout` seconds pass (an idle engine waits
        here instead of spinning)."""
        if self._compiling:
            wait(list(self._compiling.values()), timeout=timeout, return_when="FIRST_COMPLETED")

    # ---- per request ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether any request has a matcher (otherwise steps skip bitmasks entirely)."""
        return bool(self._matchers)

    def remove(self, req_id: RequestId) -> None:
        self._compiling.pop(req_id, None)
        self._matchers.pop(req_id, None)

    def accept(self, req_id: RequestId, token_ids: Sequence[int]) -> None:
        """Advance a request's matcher by its confirmed tokens."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return
        for token in token_ids:
            if matcher.is_terminated():
                return
            if not matcher.accept_token(token):
                # Only reachable if a token bypassed the mask (e.g. a stop token forced by the
                # scheduler); the output then no longer follows the constraint.
                logger.warning("request %s: token %d breaks its structured-output constraint", req_id, token)
                return

    # ---- per step ------------------------------------------------------------------------------
    def bitmask(
        self, req_ids: Sequence[RequestId], drafts: Mapping[RequestId, Sequence[int]]
    ) -> torch.Tensor | None:
        """The host bitmask of one step's sampled positions: each request of `req_ids` in order,
        one row per position (1 + its drafts). None when no request in the step is constrained."""
        matchers = self._matchers
        if not matchers or not any(r in matchers for r in req_ids):
            return None
        total = len(req_ids) + sum(len(d) for r, d in drafts.items() if d)
        buf = self._rows(total)
        buf.fill_(-1)
        batch: list[GrammarMatcher] = []
        batch_rows: list[int] = []
        row = 0
        for req_id in req_ids:
            draft = drafts.get(req_id) or ()
            matcher = matchers.get(req_id)
            if matcher is not None and not matcher.is_terminated():
                if draft:
                    self._fill_with_drafts(matcher, draft, buf, row)
                else:
                    batch.append(matcher)
                    batch_rows.append(row)
            row += 1 + len(draft)
        if batch:
            self.backend().fill_bitmasks(batch, buf, batch_rows)
        return buf

    def _fill_with_drafts(
        self, matcher: GrammarMatcher, draft: Sequence[int], buf: torch.Tensor, row: int
    ) -> None:
        matcher.fill_next_token_bitmask(buf, row)
        accepted = 0
        for j, token in enumerate(draft):
            if matcher.is_terminated() or not matcher.accept_token(token):
                break  # later positions stay all-allowed: the sampler rejects this draft anyway
            accepted += 1
            matcher.fill_next_token_bitmask(buf, row + j + 1)
        if accepted:
            matcher.rollback(accepted)

    def _rows(self, total: int) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.shape[0] < total:
            size = max(total, 2 * buf.shape[0] if buf is not None else 64)
            buf = allocate_bitmask(size, self.backend().vocab_size)
            if self._pin and torch.cuda.is_available():
                buf = buf.pin_memory()
            self._buffer = buf
        return buf[:total]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
