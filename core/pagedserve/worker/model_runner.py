"""The model runner: applies a `SchedulerOutput` to the persistent batch, runs one forward, samples.

One step, in order (the order `SchedulerOutput` documents):
  1. drop rows of finished and preempted requests;
  2. swap blocks out/in, then copy-on-write copies, through the platform's cache ops;
  3. add rows for new requests, apply new tokens / blocks to the others;
  4. build inputs and `AttentionMetadata` once for all layers (numpy over the persistent rows);
  5. forward inside a `forward_context`, logits only where something is sampled (or prompt
     logprobs are wanted), then the batched sampler; pooling requests (`LLM.embed`) sample
     nothing: their prompt's final hidden states are pooled, chunk by chunk.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.attention.forward_context import ForwardContext
from pagedserve.lora.request import LoRARequest
from pagedserve.models.spec import PagedCausalLM
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.grammar_mask import GrammarBitmaskFn
from pagedserve.sampling.logprobs import compute_prompt_logprobs, logprobs_to_dicts
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.rows import TokenHistories
from pagedserve.sampling.sampler import Sampler
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.output import CachedRequestData, SchedulerOutput
from pagedserve.types import RequestId
from pagedserve.worker.async_output import (
    LogprobRequests,
    ModelRunnerOutput,
    PendingOutput,
    TokenLogprobs,
    upload,
)
from pagedserve.worker.cascade_step import CascadeSteps
from pagedserve.worker.compile.cpu_compile import CompiledForward
from pagedserve.worker.compile.gpu_compile import GpuCompiledForward
from pagedserve.worker.graphs.cuda_graphs import PiecewiseCudaGraphs
from pagedserve.worker.graphs.full_cuda_graphs import FullDecodeGraphs
from pagedserve.worker.graphs.full_mixed_graphs import FullMixedGraphs
from pagedserve.worker.input_batch import InputBatch, RowState
from pagedserve.worker.kv_caches import KVCaches
from pagedserve.worker.startup_times import StartupTimes
from pagedserve.worker.step_forward import StepForward
from pagedserve.worker.target_hidden import TargetHidden

if TYPE_CHECKING:
    from pagedserve.lora.manager import LoRAManager


@dataclass(slots=True)
class _PoolState:
    """A pooling request's vector so far, carried across the chunks of its prompt (and across a
    swap-mode preemption, which resumes where it stopped)."""

    params: PoolingParams
    num_pooled: int = 0  # prompt positions seen so far
    # MEAN: the float32 sum of the positions seen; CLS: the first position's; LAST: unused
    partial: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """Where the rows of this step sit in the flattened token dimension."""

    rows: np.ndarray  # [num_sched_reqs] persistent-batch row of each scheduled request, ascending
    req_ids: list[RequestId]  # scheduled request ids, in `rows` order
    num_sched: np.ndarray  # [num_sched_reqs] tokens scheduled per request (drafts included)
    query_start: np.ndarray  # [num_sched_reqs + 1]
    positions: np.ndarray  # [num_tokens] absolute position of every scheduled token
    drafts: dict[RequestId, list[int]]  # req_id -> draft tokens scored this step
    num_drafts: np.ndarray  # [num_sched_reqs] len(drafts[req_id]); 0 for requests without drafts
    # [num_sched_reqs] 1 where the request's first token is an output the previous step is still
    # sampling (asynchronous scheduling): its input comes from that step's device tensor
    pending: np.ndarray


class ModelRunner:
    """Owns the model, the KV caches, the persistent batch and the sampler of one device."""

    def __init__(
        self,
        model: PagedCausalLM,
        backend: AttentionBackend,
        cache_ops: CacheOps,
        *,
        kv: KVCaches,
        max_num_reqs: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        device: torch.device,
        seed: int = 0,
        new_kv_reads: bool = False,  # `backend.enable_new_kv_reads()` answered True
        forward: StepForward | None = None,  # the forwards start-up built; None: the model's, eagerly
        lora: LoRAManager | None = None,  # with enable_lora: the adapters' slots; None keeps LoRA out
        startup_times: StartupTimes | None = None,  # what getting `forward` ready cost (GPUs)
        # Drafters that read the target's hidden states (EAGLE): called after every forward.
        forward_listener: Callable[[TargetHidden], None] | None = None,
        cascade: CascadeSteps | None = None,  # steps that may read a shared prefix once (API 1.16)
    ) -> None:
        """Everything the runner serves with is built before it (`startup.runner_setup`) and given
        here; nothing outside this class sets its attributes afterwards."""
        self.model = model
        self.spec = model.spec
        self.backend = backend
        self.cache_ops = cache_ops
        self.block_size = kv.block_size
        self.device = device
        self.eos_token_id = min(eos_token_ids) if eos_token_ids else None
        self.extra_eos_ids = eos_token_ids
        self.kv_caches = kv.layers
        self.kv_scales = kv.scales
        self.swap_caches = kv.swap
        self.new_kv_reads = new_kv_reads
        max_blocks_per_req = -(-max_model_len // kv.block_size)
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks_per_req, device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.forward = forward if forward is not None else StepForward(model)
        self.startup_times = startup_times
        # The last launched step's output: its device tokens are the next step's placeholder inputs.
        self._last: PendingOutput | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pools: dict[RequestId, _PoolState] = {}  # req_id -> pooling request mid-prompt
        self.lora = lora
        self.forward_listener = forward_listener
        self.cascade = cascade  # where the engine may cascade (`cascade_step`); None: never

    # The paths of `forward`, by their old names (read-only: they are built at start-up).
    @property
    def full_graphs(self) -> FullDecodeGraphs | None:
        return self.forward.full_decode

    @property
    def mixed_graphs(self) -> FullMixedGraphs | None:
        return self.forward.full_mixed

    @property
    def cuda_graphs(self) -> PiecewiseCudaGraphs | None:
        return self.forward.piecewise

    @property
    def compiled(self) -> CompiledForward | GpuCompiledForward | None:
        return self.forward.compiled

    def swap_cascade(self, planner: CascadeSteps | None) -> CascadeSteps | None:
        """Plan later steps' cascades with `planner` (None: never cascade) and return the planner
        before it. For benchmarks that compare cascade on and off in one engine; the graphs
        captured at start-up stay as they are."""
        before, self.cascade = self.cascade, planner
        return before

    def drop_graphs(self) -> None:
        """Forget every captured CUDA graph; later steps run the compiled or eager forward. Waits
        for the device, so no replay is in flight when the graphs go. Mutates the runner."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.forward = self.forward.without_graphs()
        gc.collect()

    # ----------------------------------------------------------------------------- one step
    def execute(
        self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> ModelRunnerOutput:
        """Run one step and wait for its output. `grammar_bitmask` (structured outputs) is called
        once the forward is launched, so its host work overlaps the device's. Mutates the
        persistent batch and the KV caches."""
        return self.launch(so, grammar_bitmask).result()

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None) -> PendingOutput:
        """Queue one step on the device and return without waiting for it; its output comes
        with `result()`. Outputs the previous step is still sampling may be scheduled as this
        step's inputs (asynchronous scheduling): they are read on the device. Mutates the
        persistent batch and the KV caches."""
        self._apply_diff(so)
        if so.total_num_scheduled_tokens == 0:
            return PendingOutput([], {}, None, first_position=np.zeros(0, dtype=np.int64))
        plan = self._plan(so)
        metadata, input_ids, positions = self._build_inputs(plan)
        if plan.pending.any():
            self._read_placeholders(plan, input_ids)
        ctx = ForwardContext(
            metadata,
            self.kv_caches,
            self.backend,
            self.cache_ops,
            kv_scales=self.kv_scales,
            new_kv_reads=self.new_kv_reads,
        )
        hidden = self.forward.run(ctx, input_ids, positions)  # on the path `step_path` picks
        if self.forward_listener is not None:
            self.forward_listener(TargetHidden(plan.req_ids, plan.query_start, plan.positions, hidden))
        pooled = self._pool(plan, hidden) if self._pools else None
        out = self._sample(plan, hidden, grammar_bitmask, pooled)
        self._last = out
        return out

    def _read_placeholders(self, plan: _StepPlan, input_ids: torch.Tensor) -> None:
        """Copy, on the device, the previous step's sampled token of every request whose first
        input is one (`plan.pending`) into `input_ids`. Mutates input_ids."""
        last = self._last
        which = np.nonzero(plan.pending)[0]
        if last is None or last.token_ids is None:
            raise RuntimeError(
                f"request {plan.req_ids[int(which[0])]!r} was scheduled on an output no step sampled"
            )
        src = last.positions_of([plan.req_ids[i] for i in which.tolist()])
        dst = plan.query_start[which]
        device = input_ids.device
        input_ids[upload(dst, device)] = last.token_ids[upload(src, device)]

    def _fill_pending_history(self, plan: _StepPlan) -> None:
        """Write the previous step's sampled tokens into the rows of this step's pending requests,
        just past their known tokens, so that penalties and bad words see them in the histories.
        Waits for the previous step (not this one). Mutates the batch's token array only."""
        assert self._last is not None  # _read_placeholders checked
        which = np.nonzero(plan.pending)[0]
        tokens = np.array(self._last.host_tokens(), dtype=np.int64)
        rows = plan.rows[which]
        self.batch.token_ids[rows, self.batch.num_tokens[rows]] = tokens[
            self._last.positions_of([plan.req_ids[i] for i in which.tolist()])
        ]

    def _apply_diff(self, so: SchedulerOutput) -> None:
        batch = self.batch
        batch.wait_for_uploads()  # the previous step's copies read host buffers written below
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(req_id)
        if self._pools:
            for req_id in so.finished_req_ids:
                self._pools.pop(req_id, None)
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            self._swap(so)
        if so.blocks_to_copy:
            mapping = torch.tensor(so.blocks_to_copy, dtype=torch.int64, device=self.device)
            self.cache_ops.copy_blocks(self.kv_caches, mapping)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            if not isinstance(params, SamplingParams):
                raise TypeError(f"request {new.req_id!r}: sampling_params must be SamplingParams")
            state = RowState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=params,
                sample_index=_sample_index(new.req_id),
                lora_int_id=self._place_adapter(new.lora_request),
            )
            batch.add(state, new.all_token_ids, new.num_computed_tokens, new.block_ids)
            if new.pooling_params is not None:
                self._start_pooling(new.req_id, new.pooling_params, new.num_computed_tokens)
        if so.scheduled_cached_reqs:
            self._apply_cached(so.scheduled_cached_reqs)

    def _place_adapter(self, lora_request: LoRARequest | None) -> int:
        """Put a new row's adapter into a slot (before the row is added); returns its
        lora_int_id (0: none). Mutates the LoRA slots."""
        if lora_request is None:
            return 0
        if self.lora is None:
            raise RuntimeError("a request with a LoRA adapter reached a runner built without enable_lora")
        self.lora.acquire(lora_request, (row.lora_int_id for row in self.batch.rows))
        return lora_request.lora_int_id

    def _apply_cached(self, cached: list[CachedRequestData]) -> None:
        """Apply the running requests' diffs. This runs for every running request every step, so
        the diffs are taken apart column by column by C-level iteration (zip, map, compress),
        tokens and counters are stored with numpy, and Python loops only over the few rows whose
        block table changed."""
        batch = self.batch
        req_ids, new_tokens, new_blocks, replaced, num_computed = zip(*cached, strict=True)
        n = len(req_ids)
        try:
            rows = np.fromiter(map(batch.row_of.__getitem__, req_ids), dtype=np.int64, count=n)
        except KeyError as exc:
            raise RuntimeError(
                f"scheduler sent cached request {exc.args[0]!r} that the worker has no row for"
            ) from None
        counts = np.fromiter(map(len, new_tokens), dtype=np.int64, count=n)
        if counts.any():
            flat = np.fromiter(
                itertools.chain.from_iterable(new_tokens), dtype=np.int64, count=int(counts.sum())
            )
            grown = counts > 0
            batch.append_tokens_batched(rows[grown], counts[grown], flat)
        for i in itertools.compress(range(n), map(operator.is_not, replaced, itertools.repeat(None))):
            batch.set_blocks(int(rows[i]), replaced[i])
        for i in itertools.compress(range(n), new_blocks):  # replaced rows send no new blocks
            if replaced[i] is None:
                batch.append_blocks(int(rows[i]), new_blocks[i])
        batch.num_computed_tokens[rows] = np.fromiter(num_computed, dtype=np.int64, count=n)

    def _swap(self, so: SchedulerOutput) -> None:
        if self.swap_caches is None:
            raise RuntimeError("the scheduler asked for a swap but no swap space was allocated")
        if so.blocks_to_swap_out:
            out = torch.tensor(so.blocks_to_swap_out, dtype=torch.int64)
            for dev, host in zip(self.kv_caches, self.swap_caches, strict=True):
                self.cache_ops.swap_blocks(dev, host, out)
        if so.blocks_to_swap_in:
            into = torch.tensor(so.blocks_to_swap_in, dtype=torch.int64)
            for dev, host in zip(self.kv_caches, self.swap_caches, strict=True):
                self.cache_ops.swap_blocks(host, dev, into)

    def _plan(self, so: SchedulerOutput) -> _StepPlan:
        batch = self.batch
        row_of = batch.row_of
        scheduled = so.num_scheduled_tokens
        n = len(scheduled)
        ids = list(scheduled)
        rows = np.fromiter(map(row_of.__getitem__, ids), dtype=np.int64, count=n)
        num_sched = np.fromiter(scheduled.values(), dtype=np.int64, count=n)
        req_ids = ids
        if n > 1 and not bool((rows[1:] > rows[:-1]).all()):
            order = np.argsort(rows, kind="stable")
            rows, num_sched = rows[order], num_sched[order]
            req_ids = list(operator.itemgetter(*order.tolist())(ids))
        drafts = so.scheduled_spec_decode_tokens
        num_drafts = np.zeros(n, dtype=np.int64)
        for req_id, draft in drafts.items():
            # Drafts follow the known tokens; they are inputs of this step only (not confirmed tokens).
            row = row_of[req_id]
            start = int(batch.num_tokens[row])
            if start + len(draft) > batch.max_model_len:
                raise RuntimeError(f"request {req_id!r}: drafts would run past max_model_len")
            batch.token_ids[row, start : start + len(draft)] = draft
            num_drafts[np.searchsorted(rows, row)] = len(draft)
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start[1:])
        total = int(query_start[-1])
        req_of_token = np.repeat(np.arange(n), num_sched)
        offsets = np.arange(total) - query_start[:-1][req_of_token]
        computed = batch.num_computed_tokens[rows]
        positions = computed[req_of_token] + offsets
        # The row holds the outputs the scheduler confirmed; one computed past them is an output
        # of the previous step that the scheduler scheduled before it was known.
        pending = (computed >= batch.num_tokens[rows]).astype(np.int64)
        return _StepPlan(rows, req_ids, num_sched, query_start, positions, dict(drafts), num_drafts, pending)

    def _build_inputs(self, plan: _StepPlan) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        batch = self.batch
        bs = self.block_size
        rows_per_token = np.repeat(plan.rows, plan.num_sched)
        input_ids = batch.token_ids[rows_per_token, plan.positions]
        block_idx = plan.positions // bs
        slots = batch.block_table.np[rows_per_token, block_idx].astype(np.int64) * bs + plan.positions % bs
        seq_lens = (batch.num_computed_tokens[plan.rows] + plan.num_sched).astype(np.int32)
        num_reqs = len(plan.rows)
        if num_reqs == batch.num_reqs:  # every row scheduled: the persistent table is the table
            block_table = batch.block_table.to_device(num_reqs)
        else:
            block_table = upload(batch.block_table.np[plan.rows], self.device)
        # Two transfers for the five per-step arrays (one per dtype), then mark them for the
        # next step's writes (`wait_for_uploads`).
        (ids_dev, _), (pos_dev, _), (slots_dev, _) = batch.upload_i64.upload(input_ids, plan.positions, slots)
        i32 = [plan.query_start.astype(np.int32), seq_lens]
        if self.lora is not None:
            i32.append(self._lora_mapping(plan))
        (qsl_dev, qsl_cpu), (seq_dev, seq_cpu), *lora_dev = batch.upload_i32.upload(*i32)
        if self.lora is not None:
            # Into the fixed buffer every LoRA layer (and every CUDA graph) reads, on the stream.
            self.lora.mapping.buffer.copy_(lora_dev[0][0], non_blocking=True)
        batch.upload_fence.record()
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=len(input_ids),
            max_query_len=int(plan.num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=qsl_dev,
            seq_lens=seq_dev,
            block_table=block_table,
            slot_mapping=slots_dev,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        if self.cascade is not None:
            metadata = self.cascade.apply(metadata, batch.block_table.np[plan.rows], plan.num_sched, seq_lens)
        return metadata, ids_dev, pos_dev

    def _lora_mapping(self, plan: _StepPlan) -> np.ndarray:
        """The step's LoRA mapping buffer (`LoRAMapping.pack`): every token gets its request's
        adapter slot. Pure."""
        assert self.lora is not None
        slot_of, rows = self.lora.slot_of, self.batch.rows
        row_slots = np.fromiter(
            (slot_of(rows[row].lora_int_id) for row in plan.rows.tolist()),
            dtype=np.int64,
            count=len(plan.rows),
        )
        return self.lora.mapping.pack(np.repeat(row_slots, plan.num_sched))

    # ----------------------------------------------------------------------------- pooling
    def _start_pooling(self, req_id: RequestId, params: PoolingParams, num_computed: int) -> None:
        """Begin (or, after a swap-in, continue) pooling a request whose row was just added.
        Mutates the runner's pooling states."""
        state = self._pools.get(req_id)
        if num_computed == 0 or state is None:
            if num_computed and params.needs_every_position:
                raise RuntimeError(
                    f"pooling request {req_id!r} starts at prompt position {num_computed}: "
                    f"{params.pooling_type} pooling needs every position's hidden state"
                )
            self._pools[req_id] = _PoolState(params)
        elif params.needs_every_position and state.num_pooled != num_computed:
            raise RuntimeError(
                f"pooling request {req_id!r} resumes at position {num_computed} but pooled {state.num_pooled}"
            )

    def _pool(self, plan: _StepPlan, hidden: torch.Tensor) -> dict[RequestId, torch.Tensor]:
        """Fold this step's chunk of every scheduled pooling request into its vector; return the
        vectors of those whose prompt this step completes (req_id -> [hidden_size] float32, on
        the device), forgetting their state. Mutates the pooling states."""
        pools = self._pools
        batch = self.batch
        done: dict[RequestId, torch.Tensor] = {}
        for i, req_id in enumerate(plan.req_ids):
            state = pools.get(req_id)
            if state is None:
                continue
            row = int(plan.rows[i])
            start, n = int(plan.query_start[i]), int(plan.num_sched[i])
            computed = int(batch.num_computed_tokens[row])
            prompt_len = int(batch.num_prompt_tokens[row])
            kind = state.params.pooling_type
            if kind == "MEAN":
                chunk_sum = hidden[start : start + n].float().sum(dim=0)
                state.partial = chunk_sum if state.partial is None else state.partial + chunk_sum
            elif kind == "CLS" and computed == 0:
                state.partial = hidden[start].float()
            state.num_pooled = computed + n
            if computed + n < prompt_len:
                continue
            if kind == "LAST":
                vector = hidden[start + n - 1].float()
            else:
                assert state.partial is not None  # the chunk holding position 0 set it
                vector = state.partial / prompt_len if kind == "MEAN" else state.partial
            if state.params.task == "classify":  # [num_labels] logits of the classification head
                vector = self.model.classify(vector[None])[0]
            elif state.params.normalize:
                vector = torch.nn.functional.normalize(vector, p=2.0, dim=0)
            done[req_id] = vector
            del pools[req_id]
        return done

    # ----------------------------------------------------------------------------- sampling
    def _sample(
        self,
        plan: _StepPlan,
        hidden: torch.Tensor,
        grammar_bitmask: GrammarBitmaskFn | None,
        pooled: dict[RequestId, torch.Tensor] | None = None,
    ) -> PendingOutput:
        """Sample every request whose chunk reached its last known token: one position, plus one
        per draft scored. Per-row sampling inputs come from the persistent `SamplingRows`; the
        only Python loops run over requests with drafts, logprobs or prompt logprobs. The sampled
        ids stay on the device; the host reads them through the returned `PendingOutput`."""
        prompt_lp = self._all_prompt_logprobs(plan, hidden)
        batch = self.batch
        # A chunked prefill that has not reached the end of its prompt samples nothing.
        known = batch.num_tokens[plan.rows] + plan.pending
        samples = batch.num_computed_tokens[plan.rows] + plan.num_sched - plan.num_drafts >= known
        if pooled is not None:  # pooling requests sample nothing, not even at the end of their prompt
            samples &= np.fromiter((r not in pooled for r in plan.req_ids), bool, count=len(plan.req_ids))
        per_req = np.where(samples, plan.num_drafts + 1, 0)  # sampled positions per request
        total = int(per_req.sum())
        if total == 0:
            return PendingOutput(
                [],
                {},
                None,
                first_position=np.zeros(0, dtype=np.int64),
                prompt_logprobs=prompt_lp,
                pooled=pooled,
            )
        first = np.cumsum(per_req) - per_req  # index of each request's first sampled position
        owner = np.repeat(np.arange(len(per_req)), per_req)  # scheduled request of each position
        draft_index = np.arange(total) - first[owner]  # j: the position after j drafts
        logits = self.model.compute_logits(self._sampled_hidden(plan, hidden, owner, draft_index))
        rows = plan.rows[owner]
        meta = self._sampling_metadata(plan, logits, rows, owner, draft_index)
        sampling_reqs = np.nonzero(samples)[0]
        if len(sampling_reqs) == len(plan.req_ids):
            req_ids = plan.req_ids
        else:  # some requests are mid-prefill (rarely many): pick the sampling ones
            req_ids = [plan.req_ids[i] for i in sampling_reqs.tolist()]
        bitmask = grammar_bitmask(req_ids, plan.drafts) if grammar_bitmask is not None else None
        if bitmask is not None:
            meta = dataclasses.replace(meta, token_bitmask=bitmask.to(logits.device, non_blocking=True))
        out = self.sampler(logits, meta)
        starts = first[sampling_reqs]
        logprobs = None
        if out.logprobs is not None:
            wanted = np.nonzero(batch.sampling.wants_logprobs[plan.rows[sampling_reqs]])[0].tolist()
            logprobs = LogprobRequests(
                out.logprobs,
                batch.sampling.num_logprobs[rows].tolist(),
                [(req_ids[k], int(starts[k])) for k in wanted],
            )
        return PendingOutput(
            req_ids,
            plan.drafts,
            out.sampled_token_ids,
            first_position=starts,
            copy_stream=self._copy_stream,
            logprobs=logprobs,
            prompt_logprobs=prompt_lp,
            pooled=pooled,
        )

    def _all_prompt_logprobs(
        self, plan: _StepPlan, hidden: torch.Tensor
    ) -> dict[RequestId, list[TokenLogprobs]]:
        """The prompt logprobs of this step's chunk of every request that asked for them
        (req_id -> one entry per prompt token scored); the loop runs over those requests only."""
        batch = self.batch
        prompt_lp: dict[RequestId, list[TokenLogprobs]] = {}
        for i in np.nonzero(batch.sampling.wants_prompt_logprobs[plan.rows])[0].tolist():
            row = int(plan.rows[i])
            start, n = int(plan.query_start[i]), int(plan.num_sched[i])
            self._prompt_logprobs(
                batch.rows[row], hidden, start, int(batch.num_computed_tokens[row]), n, prompt_lp
            )
        return prompt_lp

    def _sampled_hidden(
        self, plan: _StepPlan, hidden: torch.Tensor, owner: np.ndarray, draft_index: np.ndarray
    ) -> torch.Tensor:
        """The hidden states of the sampled positions, [num_positions, hidden_size]: position j of
        a request (`owner`: its scheduled index; `draft_index`: j) is scored by the token after
        its j-th draft."""
        # A request's k drafts are its last k tokens; position j is scored by token (end - 1 - k + j).
        token_index = plan.query_start[owner + 1] - 1 - plan.num_drafts[owner] + draft_index
        num_tokens = int(plan.query_start[-1])
        if len(owner) == num_tokens:  # every token is sampled (pure decode): no gather needed
            return hidden[:num_tokens]
        return hidden.index_select(0, upload(token_index, hidden.device))

    def _sampling_metadata(
        self,
        plan: _StepPlan,
        logits: torch.Tensor,
        rows: np.ndarray,
        owner: np.ndarray,
        draft_index: np.ndarray,
    ) -> SamplingMetadata:
        """The sampler's inputs for the sampled positions (`rows`: the batch row of each;
        `owner`, `draft_index`: its scheduled request and draft offset). Each position's token
        history ends just before it, so penalties and bad words see the drafts it follows."""
        batch = self.batch
        sampling = batch.sampling
        if plan.pending.any() and sampling.reads_outputs(plan.rows[plan.pending > 0]):
            self._fill_pending_history(plan)
        histories = TokenHistories(
            batch.token_ids,
            rows,
            batch.num_prompt_tokens[rows],
            batch.num_tokens[rows] + plan.pending[owner] + draft_index,
        )
        return sampling.metadata(
            histories,
            vocab_size=logits.shape[1],
            eos_token_id=self.eos_token_id,
            device=logits.device,
            generator=self.generator,
        )

    def _prompt_logprobs(
        self,
        state: RowState,
        hidden: torch.Tensor,
        start: int,
        computed: int,
        n: int,
        out: dict[RequestId, list[TokenLogprobs]],
    ) -> None:
        """Score the prompt tokens this chunk predicts; emit all of them once the prompt is done."""
        params = state.sampling_params
        assert isinstance(params, SamplingParams) and params.prompt_logprobs is not None
        prompt_len = len(state.prompt_token_ids)
        if state.prompt_logprobs_sent:
            return
        # Position p predicts prompt token p + 1; only positions < prompt_len - 1 score a prompt token.
        last = min(computed + n, prompt_len - 1)
        if last > computed:
            rows = torch.arange(start, start + last - computed, device=hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            next_ids = torch.tensor(state.prompt_token_ids[computed + 1 : last + 1], device=logits.device)
            tensors = compute_prompt_logprobs(logits, next_ids, params.prompt_logprobs)
            state.prompt_logprobs.extend(
                logprobs_to_dicts(tensors.to_cpu(), [params.prompt_logprobs] * (last - computed))
            )
        if computed + n >= prompt_len:
            out[state.req_id] = list(state.prompt_logprobs)
            state.prompt_logprobs_sent = True


def _sample_index(req_id: RequestId) -> int:
    """The sample number an n > 1 child carries in its id (`<parent>#<index>`); 0 otherwise."""
    _, sep, tail = req_id.rpartition("#")
    return int(tail) if sep and tail.isdigit() else 0
