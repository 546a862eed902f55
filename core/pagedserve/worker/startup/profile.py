"""Measuring the activation memory of the largest step, for GPU KV-cache sizing."""

from __future__ import annotations

import torch

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.spec import PagedCausalLM
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata


@torch.inference_mode()
def profile_activation_bytes(
    model: PagedCausalLM,
    backend: AttentionBackend,
    cache_ops: CacheOps,
    *,
    num_tokens: int,
    num_reqs: int,
    block_size: int,
    device: torch.device,
) -> int:
    """Peak bytes allocated above the current level by one forward of `num_tokens` tokens split
    over `num_reqs` prompts, plus their logits, minus the temporary KV cache it writes into.
    Mutates nothing that outlives the call."""
    if device.type != "cuda":
        raise ValueError(f"activation profiling needs a CUDA device, got {device}")
    spec = model.spec
    num_reqs = max(1, min(num_reqs, num_tokens))
    base, extra = divmod(num_tokens, num_reqs)
    lens = [base + (1 if i < extra else 0) for i in range(num_reqs)]
    blocks_per_req = -(-max(lens) // block_size)
    num_blocks = num_reqs * blocks_per_req
    table = torch.arange(num_blocks, dtype=torch.int32).view(num_reqs, blocks_per_req)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    kv = [
        torch.zeros(spec.kv_cache_shape(num_blocks, block_size), dtype=spec.dtype, device=device)
        for _ in range(spec.num_layers)
    ]
    kv_bytes = sum(t.numel() * t.element_size() for t in kv)
    metadata = AttentionMetadata.build(lens, lens, table, block_size, device)
    ids = torch.randint(0, spec.vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    with forward_context(ForwardContext(metadata, kv, backend, cache_ops)):
        hidden = model(ids, positions)
    last = metadata.query_start_loc[1:].long() - 1
    model.compute_logits(hidden.index_select(0, last))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - kv_bytes
    del kv, hidden
    torch.cuda.empty_cache()
    return max(peak, 0)
