"""The persistent input batch: one preallocated row per request the worker knows.

A request's token ids, block-table row and counters stay in place from step to step; each step
applies only the scheduler's diff (rows added, rows dropped, new tokens, new block ids). Rows are
kept dense (`0 .. num_reqs - 1`): dropping a row moves the last row into the hole, so the block
table of a full decode batch is one contiguous slice. The rows' sampling parameters live beside
them in `SamplingRows`, moved in step, so the sampler's per-row inputs are never rebuilt from
request objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedserve.outputs import Logprob
from pagedserve.sampling.rows import SamplingRows
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.types import BlockId, RequestId
from pagedserve.worker.buffers import PackedUpload, StagedBuffer, UploadFence


@dataclass(slots=True)
class RowState:
    """Per-request facts that are not arrays. The outputs generated so far are the row's
    `token_ids[len(prompt_token_ids) : num_tokens]`."""

    req_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sample_index: int  # which of its request's n samples this row is
    lora_int_id: int = 0  # its LoRA adapter's id; 0: the base model
    # Prompt logprobs gathered chunk by chunk (token id -> Logprob per prompt token after the first),
    # sent once when the prompt is complete.
    prompt_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs_sent: bool = False


class InputBatch:
    """Dense rows of per-request state on the host, with a staged device block table.

    All methods mutate the batch unless they say otherwise."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        # Token ids are stored as int64 so a gather feeds the embedding without a cast.
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # row -> prompt + known outputs
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # row -> prompt length
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # row -> tokens in the cache
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # row -> used width of the table row
        self.block_table = StagedBuffer((max_num_reqs, max_blocks_per_req), torch.int32, device)
        # Per-step inputs (token ids, positions, slots; query starts, sequence lengths), one
        # transfer per dtype, and the fence that keeps the host from overwriting them early.
        self.upload_i64 = PackedUpload(torch.int64, device)
        self.upload_i32 = PackedUpload(torch.int32, device)
        self.upload_fence = UploadFence(device)
        self.rows: list[RowState] = []  # row -> state; len(rows) == num_reqs
        self.row_of: dict[RequestId, int] = {}  # req_id -> row
        self.sampling = SamplingRows(max_num_reqs)  # row -> sampling parameters, same rows

    @property
    def num_reqs(self) -> int:
        return len(self.rows)

    def wait_for_uploads(self) -> None:
        """Block until the previous step's host -> device copies have run; call before writing
        the host buffers of a new step (the block table included)."""
        self.upload_fence.wait()

    def add(
        self,
        state: RowState,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        block_ids: Sequence[BlockId],
    ) -> int:
        """Append a row for a request the batch does not hold; return its row index."""
        if state.req_id in self.row_of:
            raise ValueError(f"request {state.req_id!r} already has a row in the input batch")
        if self.num_reqs >= self.max_num_reqs:
            raise RuntimeError(
                f"input batch is full ({self.max_num_reqs} rows): the scheduler admitted more requests "
                "than max_num_seqs"
            )
        n = len(token_ids)
        if n > self.max_model_len:
            raise ValueError(
                f"request {state.req_id!r} has {n} tokens, more than max_model_len={self.max_model_len}"
            )
        row = self.num_reqs
        self.rows.append(state)
        self.row_of[state.req_id] = row
        self.sampling.add(state.sampling_params, state.sample_index)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[row] = 0
        self.set_blocks(row, block_ids)
        return row

    def remove(self, req_id: RequestId) -> None:
        """Drop a request's row (no-op for an unknown id), moving the last row into the hole."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        self.sampling.remove(row)
        if row != last:
            moved = self.rows[last]
            self.rows[row] = moved
            self.row_of[moved.req_id] = row
            width = int(self.num_tokens[last])
            self.token_ids[row, :width] = self.token_ids[last, :width]
            self.num_tokens[row] = self.num_tokens[last]
            self.num_prompt_tokens[row] = self.num_prompt_tokens[last]
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            nb = int(self.num_blocks[last])
            self.block_table.np[row, :nb] = self.block_table.np[last, :nb]
            self.num_blocks[row] = nb
        self.rows.pop()

    def append_tokens(self, row: int, token_ids: Sequence[int]) -> None:
        """Append confirmed tokens (outputs the scheduler accepted) to a row."""
        if not token_ids:
            return
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(
                f"request {self.rows[row].req_id!r} would grow to {end} tokens, past max_model_len="
                f"{self.max_model_len}"
            )
        self.token_ids[row, start:end] = token_ids
        self.num_tokens[row] = end

    def append_tokens_batched(self, rows: np.ndarray, counts: np.ndarray, token_ids: np.ndarray) -> None:
        """`append_tokens` for many rows at once: rows[i] (distinct) gets the next counts[i]
        tokens of the flat `token_ids`."""
        starts = self.num_tokens[rows]
        ends = starts + counts
        if len(rows) and int(ends.max()) > self.max_model_len:
            i = int(np.argmax(ends))
            raise ValueError(
                f"request {self.rows[int(rows[i])].req_id!r} would grow to {int(ends[i])} tokens, past "
                f"max_model_len={self.max_model_len}"
            )
        # Column of every new token: its row's old length plus its index within the row's tokens.
        offsets = np.arange(len(token_ids)) - np.repeat(np.cumsum(counts) - counts, counts)
        self.token_ids[np.repeat(rows, counts), np.repeat(starts, counts) + offsets] = token_ids
        self.num_tokens[rows] = ends

    def append_blocks(self, row: int, block_ids: Sequence[BlockId]) -> None:
        """Append new block ids to a row's block table."""
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        if end > self.max_blocks_per_req:
            raise ValueError(
                f"request {self.rows[row].req_id!r} needs {end} blocks, more than the "
                f"{self.max_blocks_per_req} a row holds (max_model_len / block_size)"
            )
        self.block_table.np[row, start:end] = block_ids
        self.num_blocks[row] = end

    def set_blocks(self, row: int, block_ids: Sequence[BlockId]) -> None:
        """Replace a row's whole block table (new rows, copy-on-write replacements)."""
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
