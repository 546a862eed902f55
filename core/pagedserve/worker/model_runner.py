"""The model runner: applies a `SchedulerOutput` to the persistent batch, runs one forward, samples.

One step, in order (the order `SchedulerOutput` documents):
  1. drop rows of finished and preempted requests;
  2. swap blocks out/in, then copy-on-write copies, through the platform's cache ops;
  3. add rows for new requests, apply new tokens / blocks to the others;
  4. build inputs and `AttentionMetadata` once for all layers (numpy over the persistent rows);
  5. forward inside a `forward_context`, logits only where something is sampled (or prompt
     logprobs are wanted), then the batched sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.spec import PagedCausalLM
from pagedserve.outputs import Logprob
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.sampling.logprobs import compute_prompt_logprobs, logprobs_to_dicts
from pagedserve.sampling.metadata import SamplingMetadata, SamplingRequest
from pagedserve.sampling.sampler import Sampler
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.types import RequestId
from pagedserve.worker.input_batch import InputBatch, RowState

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


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """Where the rows of this step sit in the flattened token dimension."""

    rows: np.ndarray  # [num_sched_reqs] persistent-batch row of each scheduled request, ascending
    req_ids: list[RequestId]  # scheduled request ids, in `rows` order
    num_sched: np.ndarray  # [num_sched_reqs] tokens scheduled per request (drafts included)
    query_start: np.ndarray  # [num_sched_reqs + 1]
    positions: np.ndarray  # [num_tokens] absolute position of every scheduled token
    drafts: dict[RequestId, list[int]]  # req_id -> draft tokens scored this step


class ModelRunner:
    """Owns the model, the KV caches, the persistent batch and the sampler of one device."""

    def __init__(
        self,
        model: PagedCausalLM,
        backend: AttentionBackend,
        cache_ops: CacheOps,
        *,
        num_kv_blocks: int,
        block_size: int,
        max_num_reqs: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        device: torch.device,
        kv_cache_dtype: torch.dtype | None = None,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.backend = backend
        self.cache_ops = cache_ops
        self.block_size = block_size
        self.device = device
        self.eos_token_id = min(eos_token_ids) if eos_token_ids else None
        self.extra_eos_ids = eos_token_ids
        dtype = kv_cache_dtype or self.spec.dtype
        shape = self.spec.kv_cache_shape(num_kv_blocks, block_size)
        # Zeroed, not empty: a backend may multiply masked-out (never written) slots by a zero weight,
        # and 0 * NaN garbage would poison the output.
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.spec.num_layers)]
        max_blocks_per_req = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_reqs, max_model_len, max_blocks_per_req, device)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.swap_caches: list[torch.Tensor] | None = None

    def allocate_swap_space(self, num_blocks: int) -> None:
        """Allocate the CPU swap pool (one tensor per layer) used by swap-mode preemption."""
        shape = self.spec.kv_cache_shape(num_blocks, self.block_size)
        self.swap_caches = [torch.zeros(shape, dtype=c.dtype, device="cpu") for c in self.kv_caches]

    # ----------------------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. Mutates the persistent batch and the KV caches."""
        self._apply_diff(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled={})
        plan = self._plan(so)
        metadata, input_ids, positions = self._build_inputs(plan)
        ctx = ForwardContext(metadata, self.kv_caches, self.backend, self.cache_ops)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        return self._sample(plan, hidden)

    def _apply_diff(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            batch.remove(req_id)
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            self._swap(so)
        if so.blocks_to_copy:
            mapping = torch.tensor(so.blocks_to_copy, dtype=torch.int64, device=self.device)
            self.cache_ops.copy_blocks(self.kv_caches, mapping)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            if not isinstance(params, SamplingParams):
                raise TypeError(f"request {new.req_id!r}: sampling_params must be SamplingParams")
            prompt_len = len(new.prompt_token_ids)
            state = RowState(
                req_id=new.req_id,
                prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.all_token_ids[prompt_len:]),
                sampling_params=params,
                sample_index=_sample_index(new.req_id),
            )
            batch.add(state, new.all_token_ids, new.num_computed_tokens, new.block_ids)
        for cached in so.scheduled_cached_reqs:
            row = batch.row_of.get(cached.req_id)
            if row is None:
                raise RuntimeError(
                    f"scheduler sent cached request {cached.req_id!r} that the worker has no row for"
                )
            batch.append_tokens(row, cached.new_token_ids)
            if cached.replaced_block_ids is not None:
                batch.set_blocks(row, cached.replaced_block_ids)
            else:
                batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

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
        pairs = sorted((row_of[rid], rid) for rid in so.num_scheduled_tokens)
        rows = np.fromiter((p[0] for p in pairs), dtype=np.int64, count=len(pairs))
        req_ids = [p[1] for p in pairs]
        num_sched = np.fromiter(
            (so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(pairs)
        )
        drafts = so.scheduled_spec_decode_tokens
        for req_id, draft in drafts.items():
            # Drafts follow the known tokens; they are inputs of this step only (not confirmed tokens).
            row = row_of[req_id]
            start = int(batch.num_tokens[row])
            if start + len(draft) > batch.max_model_len:
                raise RuntimeError(f"request {req_id!r}: drafts would run past max_model_len")
            batch.token_ids[row, start : start + len(draft)] = draft
        query_start = np.zeros(len(pairs) + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start[1:])
        total = int(query_start[-1])
        req_of_token = np.repeat(np.arange(len(pairs)), num_sched)
        offsets = np.arange(total) - query_start[:-1][req_of_token]
        positions = batch.num_computed_tokens[rows][req_of_token] + offsets
        return _StepPlan(rows, req_ids, num_sched, query_start, positions, dict(drafts))

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
            block_table = torch.from_numpy(batch.block_table.np[plan.rows]).to(self.device)
        qsl_cpu = torch.from_numpy(plan.query_start.astype(np.int32))
        seq_cpu = torch.from_numpy(seq_lens)
        dev = self.device
        metadata = AttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=len(input_ids),
            max_query_len=int(plan.num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=qsl_cpu.to(dev),
            seq_lens=seq_cpu.to(dev),
            block_table=block_table,
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        return metadata, torch.from_numpy(input_ids).to(dev), torch.from_numpy(plan.positions).to(dev)

    # ----------------------------------------------------------------------------- sampling
    def _sample(self, plan: _StepPlan, hidden: torch.Tensor) -> ModelRunnerOutput:
        batch = self.batch
        sample_rows: list[SamplingRequest] = []  # one per scored position
        sample_index: list[int] = []  # flattened-token index of each scored position
        owners: list[tuple[RequestId, int]] = []  # (req_id, number of positions) per sampling request
        prompt_lp: dict[RequestId, list[TokenLogprobs]] = {}
        for i, req_id in enumerate(plan.req_ids):
            row = int(plan.rows[i])
            state = batch.rows[row]
            params = state.sampling_params
            assert isinstance(params, SamplingParams)
            start, n = int(plan.query_start[i]), int(plan.num_sched[i])
            computed = int(batch.num_computed_tokens[row])
            if params.prompt_logprobs is not None:
                self._prompt_logprobs(state, hidden, start, computed, n, prompt_lp)
            draft = plan.drafts.get(req_id, [])
            if computed + n - len(draft) < int(batch.num_tokens[row]):
                continue  # a chunked prefill that has not reached the end of the prompt yet
            k = len(draft)
            for j in range(k + 1):
                sample_rows.append(
                    SamplingRequest(
                        params, state.prompt_token_ids, state.output_token_ids + draft[:j], state.sample_index
                    )
                )
                sample_index.append(start + n - k - 1 + j)
            owners.append((req_id, k + 1))
        if not sample_rows:
            return ModelRunnerOutput(sampled={}, prompt_logprobs=prompt_lp)
        idx = torch.tensor(sample_index, dtype=torch.int64, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx))
        meta = SamplingMetadata.build(
            sample_rows,
            vocab_size=logits.shape[1],
            eos_token_id=self.eos_token_id,
            device=logits.device,
            generator=self.generator,
        )
        out = self.sampler(logits, meta)
        tokens = out.sampled_token_ids.tolist()
        lp_dicts = None
        if out.logprobs is not None:
            wanted = [r.params.logprobs or 0 for r in sample_rows]
            lp_dicts = logprobs_to_dicts(out.logprobs.to_cpu(), wanted)
        sampled: dict[RequestId, list[int]] = {}
        logprobs: dict[RequestId, list[TokenLogprobs]] = {}
        pos = 0
        for req_id, count in owners:
            draft = plan.drafts.get(req_id, [])
            accepted: list[int] = []
            for j in range(count):
                accepted.append(tokens[pos + j])
                # Sampling from the target and keeping the draft only when the sample equals it is
                # exact rejection sampling for deterministic (one-hot) drafts.
                if j < len(draft) and tokens[pos + j] != draft[j]:
                    break
            sampled[req_id] = accepted
            params = batch.rows[batch.row_of[req_id]].sampling_params
            assert isinstance(params, SamplingParams)
            if lp_dicts is not None and params.logprobs is not None:
                logprobs[req_id] = lp_dicts[pos : pos + len(accepted)]
            pos += count
        return ModelRunnerOutput(sampled=sampled, logprobs=logprobs, prompt_logprobs=prompt_lp)

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
