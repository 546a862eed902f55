"""Drafting with a network (a draft model or an EAGLE head) on the target's device.

Called before each step with the running requests, the proposer

  1. catches its own KV cache up with what the target computed: a draft model feeds the tokens
     the target has computed (for a decoding request also its latest sampled token), an EAGLE
     head the target's hidden states of the last forward with the token after each. A prompt is
     thereby fed in the target's chunks, one step behind it;
  2. drafts for the decoding requests: the output at each one's last fed position gives draft 1;
     then k - 1 forwards of one token per request (draft j at the position after the last) give
     the rest, each the argmax (greedy, so the runner's one-hot verification is exact).

One forward per draft position for the whole batch: the catch-up (varying lengths) with draft 1,
then one-token steps. Entries written for drafts are left in the draft cache; the next catch-up
writes the accepted tokens over them. A request the draft cache has no room for, or whose hidden
states the EAGLE head missed (a prefix-cache hit the target did not compute), gets no drafts this
step, or restarts its draft context where the target's states begin: drafts stay verified, so
either only costs acceptance.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.spec_decode.cost_model import SpeculationCostModel
from pagedserve.spec_decode.draft_cache import DraftKVCache
from pagedserve.spec_decode.network import DraftNetwork
from pagedserve.spec_decode.proposer import Proposer, TargetHidden, draft_room, is_decoding
from pagedserve.types import RequestId


@dataclass(frozen=True, slots=True)
class _Chunk:
    """What one request feeds the draft network in one forward."""

    req_id: RequestId
    first_position: int  # absolute position of its first token
    token_ids: list[int]  # the tokens fed (EAGLE: each the token after its position)
    hidden: torch.Tensor | None  # [len(token_ids), width] the states fed beside them; None: a draft model


class NetworkProposer(Proposer):
    """Drafts with `network` over its own `cache`. Single-threaded; `propose` mutates the
    requests, the draft cache and the cost model's measurements."""

    def __init__(
        self,
        network: DraftNetwork,
        cache: DraftKVCache,
        backend: AttentionBackend,
        cache_ops: CacheOps,
        num_speculative_tokens: int,
        device: torch.device,
        cost_model: SpeculationCostModel | None = None,  # None: always draft k tokens
    ) -> None:
        self.network = network
        self.cache = cache
        self.backend = backend
        self.cache_ops = cache_ops
        self.k = num_speculative_tokens
        self.device = device
        self.cost_model = cost_model
        self._target: TargetHidden | None = None  # the target's last forward, until read

    def observe_step(self, num_tokens: int, seconds: float, drafted: int, accepted: int) -> None:
        if self.cost_model is not None:
            self.cost_model.observe_target(num_tokens, seconds)
            self.cost_model.observe_acceptance(drafted, accepted)

    def on_target_forward(self, hidden: TargetHidden) -> None:
        """The model runner's `forward_listener`: keep the forward's states for the next `propose`."""
        self._target = hidden

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request]) -> None:
        running = [r for r in requests if r.status is RequestStatus.RUNNING]
        self.cache.keep_only({r.id for r in running})
        target, self._target = self._target, None
        decoding = sum(1 for r in running if is_decoding(r))
        k = self.k if self.cost_model is None else self.cost_model.choose(decoding, self.k)
        if k == 0:
            # Drafting does not pay at this batch: the draft network does not run at all. A draft
            # model catches up later from the tokens; an EAGLE head restarts its context.
            for request in running:
                request.spec_token_ids = []
            return
        chunks: list[_Chunk] = []
        rooms: list[int] = []
        ends: list[int] = []
        rows = target.rows_of() if target is not None else {}
        for request in running:
            request.spec_token_ids = []
            chunk, end = self._catch_up(request, rows, target)
            if chunk is None:
                continue
            room = draft_room(request, k) if is_decoding(request) else 0
            if not self.cache.reserve(request.id, end + max(room - 1, 0)):
                self.cache.drop(request.id)  # no room: no drafts, and the context restarts later
                continue
            chunks.append(chunk)
            rooms.append(room)
            ends.append(end)
        if not chunks:
            return
        started = time.perf_counter()
        out, carried = self._forward(chunks)
        for chunk, end in zip(chunks, ends, strict=True):
            self.cache.requests[chunk.req_id].num_computed = end
        drafting = [i for i, room in enumerate(rooms) if room > 0]
        if not drafting:
            return
        pick = torch.tensor(drafting, device=out.device)
        tokens = self.network.draft_token_ids(out.index_select(0, pick))
        state = carried.index_select(0, pick)
        drafts: list[list[int]] = [[t] for t in tokens.tolist()]
        for j in range(1, max(rooms)):
            alive = [n for n, i in enumerate(drafting) if rooms[i] > j]
            if not alive:
                break
            keep = torch.tensor(alive, device=out.device)
            step = [
                _Chunk(
                    chunks[drafting[n]].req_id,
                    ends[drafting[n]] - 1 + j,
                    [drafts[n][-1]],
                    state[n : n + 1] if self.network.reads_target_hidden else None,
                )
                for n in alive
            ]
            out_j, carried_j = self._forward(step)
            new = self.network.draft_token_ids(out_j).tolist()
            for n, token in zip(alive, new, strict=True):
                drafts[n].append(token)
            state = state.clone()
            state[keep] = carried_j
        by_id = {r.id: r for r in running}
        for n, i in enumerate(drafting):
            by_id[chunks[i].req_id].spec_token_ids = drafts[n]
        if self.cost_model is not None:
            self.cost_model.observe_draft(len(drafting), max(rooms), time.perf_counter() - started)

    def _catch_up(
        self,
        request: Request,
        rows: dict[RequestId, tuple[int, int, int]],
        target: TargetHidden | None,
    ) -> tuple[_Chunk | None, int]:
        """What the request feeds this time, and the position its draft entries reach after it
        (None: nothing to feed). Mutates the draft cache's slots only."""
        tokens = request.all_token_ids
        known = len(tokens)
        decoding = is_decoding(request)
        if not self.network.reads_target_hidden:
            end = known if decoding else min(request.num_computed_tokens, known)
            slots = self.cache.slots(request.id, 0)
            begin = slots.num_computed
            if begin >= end:
                return None, end
            return _Chunk(request.id, begin, tokens[begin:end], None), end
        # EAGLE: position i needs the target's state at i (from its last forward) and token i + 1.
        found = rows.get(request.id)
        if found is None or target is None:
            return None, 0
        row0, count, pos0 = found
        end = min(pos0 + count, known - 1, request.num_computed_tokens)
        seen = self.cache.requests.get(request.id)
        if seen is None or seen.num_computed < pos0:
            # The states before pos0 were never seen (a new request whose prefix was cached, or
            # a context dropped): the draft's context starts at pos0.
            self.cache.drop(request.id)
        begin = self.cache.slots(request.id, pos0).num_computed
        if begin >= end:
            return None, end
        hidden = target.hidden[row0 + begin - pos0 : row0 + end - pos0]
        return _Chunk(request.id, begin, tokens[begin + 1 : end + 1], hidden), end

    def _forward(self, chunks: list[_Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the network over `chunks` (each request's positions from its first, in order);
        return both outputs at each chunk's last position ([len(chunks), hidden] each). Mutates
        the draft cache."""
        cache = self.cache
        bs = cache.block_size
        query_lens = [len(c.token_ids) for c in chunks]
        seq_lens = []
        width = 1
        for c in chunks:
            slots = cache.requests[c.req_id]
            seq_lens.append(c.first_position + len(c.token_ids) - slots.start)
            width = max(width, len(slots.blocks))
        table = torch.zeros((len(chunks), width), dtype=torch.int32)
        for i, c in enumerate(chunks):
            blocks = cache.requests[c.req_id].blocks
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        metadata = AttentionMetadata.build(query_lens, seq_lens, table, bs, device=self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device)
        positions = torch.cat(
            [torch.arange(c.first_position, c.first_position + len(c.token_ids)) for c in chunks]
        ).to(self.device)
        hidden = None
        if self.network.reads_target_hidden:
            hidden = torch.cat([c.hidden for c in chunks if c.hidden is not None])
        ctx = ForwardContext(metadata, cache.caches, self.backend, self.cache_ops)
        with forward_context(ctx):
            out, carried = self.network(ids, positions, hidden)
        last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
        return out.index_select(0, last), carried.index_select(0, last)
