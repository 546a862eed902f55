"""Paged attention the obvious way: gather each request's keys and values out of the block table
into contiguous tensors, then attend with explicit scores. Slow, short, easy to check."""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata


class GatherAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "example_gather"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        head_sizes=frozenset({32, 64, 80, 96, 128, 256}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        block_sizes=frozenset({8, 16, 32}),
        sliding_window=True,
        logit_softcap=True,
    )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]
        kv_scales: KVCacheScales | None = None,  # FP8 caches only, which this backend does not declare
        new_key: torch.Tensor | None = None,  # never passed: enable_new_kv_reads answers False
        new_value: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,  # never passed: attention_sinks is not declared
    ) -> torch.Tensor:
        """Attention for every request of the batch; does not mutate `kv_cache`, writes only `out`."""
        num_q_heads, head_size = query.shape[1], query.shape[2]
        _, _, block_size, num_kv_heads, cache_head_size = kv_cache.shape
        if cache_head_size != head_size or num_q_heads % num_kv_heads != 0:
            raise ValueError(
                f"query heads x size {num_q_heads}x{head_size} do not fit cache heads x size "
                f"{num_kv_heads}x{cache_head_size} (q heads must be a multiple of kv heads)"
            )
        self.check_supported(
            head_size=head_size,
            dtype=query.dtype,
            block_size=block_size,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            kv_cache_dtype=kv_cache.dtype,  # an FP8 cache is refused: none is declared
        )
        if out is None:
            out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu.tolist()
        seq_lens = metadata.seq_lens_cpu.tolist()
        for i in range(metadata.num_reqs):
            q = query[starts[i] : starts[i + 1]]  # [query_len, num_q_heads, head_size]
            out[starts[i] : starts[i + 1]] = self._one_request(
                q, kv_cache, metadata.block_table[i], seq_lens[i], scale, sliding_window, logit_softcap
            ).to(out.dtype)
        return out

    @staticmethod
    def _one_request(
        q: torch.Tensor,  # [query_len, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        block_row: torch.Tensor,  # [max_blocks_per_req] int32
        seq_len: int,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
    ) -> torch.Tensor:  # [query_len, num_q_heads, head_size], float32
        block_size = kv_cache.shape[2]
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_row[:num_blocks].long()
        # [2, num_blocks, block_size, H_kv, D] -> [2, seq_len, H_kv, D]
        kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len].float()
        group = q.shape[1] // kv.shape[2]
        k = kv[0].repeat_interleave(group, dim=1)  # [seq_len, num_q_heads, head_size]
        v = kv[1].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [num_q_heads, query_len, seq_len]
        if logit_softcap is not None:
            scores = logit_softcap * torch.tanh(scores / logit_softcap)
        # The queries are the last query_len tokens of the sequence.
        q_pos = torch.arange(seq_len - q.shape[0], seq_len).unsqueeze(1)  # [query_len, 1]
        k_pos = torch.arange(seq_len).unsqueeze(0)  # [1, seq_len]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
