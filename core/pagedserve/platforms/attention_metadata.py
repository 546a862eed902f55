"""Per-step attention metadata: built once per step by the model runner, shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class CascadeMetadata:
    """A prefix every request of the step shares, to be read once for all of them (API 1.16).

    Tokens `[0, prefix_len)` of every request are the same tokens with the same keys and values,
    stored in the blocks `prefix_block_table` lists (token `t` in block `prefix_block_table[t //
    block_size]` at offset `t % block_size`), and every query of the step sits past them:
    `prefix_len <= seq_lens[i] - query_len_i` for every request `i`. The prefix then needs no
    causal mask, so its keys can be attended by all the step's queries at once
    (`AttentionBackend.prefix_attention`) and each request's own keys `[prefix_len, seq_len)`
    apart (`suffix_attention`); `merge_attention_states` joins the two.

    The engine gives whole blocks (the block-table prefix the requests share,
    `pagedserve.attention.cascade_plan`); the contract takes any length.
    """

    prefix_len: int  # tokens shared by every request, >= 1; exact (host twin of prefix_len_device)
    # [>= ceil(prefix_len / block_size)] int32, device: the shared blocks; entries past them arbitrary
    prefix_block_table: torch.Tensor
    prefix_len_device: torch.Tensor  # [1] int32, device: prefix_len, for kernels that read it there

    @staticmethod
    def build(prefix_blocks: torch.Tensor, prefix_len: int, block_size: int) -> CascadeMetadata:
        """The cascade metadata of a prefix of `prefix_len` tokens held by `prefix_blocks` (int32,
        on the device the kernels read it from; e.g. a view of one request's block-table row).
        Raises ValueError for an empty prefix or too few blocks. Does not mutate."""
        if prefix_len < 1:
            raise ValueError(f"a cascade prefix needs prefix_len >= 1, got {prefix_len}")
        need = -(-prefix_len // block_size)
        if prefix_blocks.dim() != 1 or prefix_blocks.shape[0] < need or prefix_blocks.dtype != torch.int32:
            raise ValueError(
                f"prefix_blocks must be int32 [>= {need}] for {prefix_len} tokens in blocks of "
                f"{block_size}, got {prefix_blocks.dtype} {tuple(prefix_blocks.shape)}"
            )
        length = torch.tensor([prefix_len], dtype=torch.int32).to(prefix_blocks.device, non_blocking=True)
        return CascadeMetadata(prefix_len, prefix_blocks, length)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Describes one flattened V1 batch to an attention backend.

    Request `i` contributes query rows `query_start_loc[i] : query_start_loc[i + 1]`; these are the
    last `query_len_i` of its `seq_lens[i]` tokens, so its context (tokens already in the cache
    before this step) is `seq_lens[i] - query_len_i`. There is no separate prefill or decode path:
    a decode is a request with `query_len_i == 1`.

    Device tensors are on the platform's device; `*_cpu` twins are host copies for backends that
    choose kernels or split counts from batch geometry without a device sync.
    """

    num_reqs: int
    num_actual_tokens: int  # == query_start_loc[-1]; rows past it are padding
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, device; query_start_loc[0] == 0
    seq_lens: torch.Tensor  # [num_reqs] int32, device; context + new tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, device; unused tail is arbitrary
    slot_mapping: torch.Tensor  # [num_tokens] int64, device; where each new token's K/V is written
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1] int32, host
    seq_lens_cpu: torch.Tensor  # [num_reqs] int32, host
    # API 1.16: the step's shared prefix when the engine runs it as cascade attention; None (the
    # default, and always for backends that do not declare `cascade_attention`): no cascade.
    cascade: CascadeMetadata | None = None

    @staticmethod
    def build(
        query_lens: list[int] | torch.Tensor,
        seq_lens: list[int] | torch.Tensor,
        block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32 (any device)
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build metadata from per-request query and sequence lengths (tests, benchmarks and the
        conformance suite use this; the model runner fills persistent buffers instead).
        Computes the slot mapping from the block table. Does not mutate its arguments."""
        q = torch.as_tensor(query_lens, dtype=torch.int32).cpu()
        s = torch.as_tensor(seq_lens, dtype=torch.int32).cpu()
        if q.shape != s.shape or q.dim() != 1:
            raise ValueError(
                f"query_lens {tuple(q.shape)} and seq_lens {tuple(s.shape)} must be equal-length 1-D"
            )
        if bool((q < 1).any()) or bool((q > s).any()):
            raise ValueError("every request needs 1 <= query_len <= seq_len")
        bt_cpu = block_table.to("cpu", torch.int32)
        if bt_cpu.shape[0] != q.shape[0]:
            raise ValueError(f"block_table has {bt_cpu.shape[0]} rows for {q.shape[0]} requests")
        need = (s + block_size - 1) // block_size
        if bool((need > bt_cpu.shape[1]).any()):
            raise ValueError("block_table is too narrow for the longest sequence")
        qsl = torch.zeros(q.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(q, 0, out=qsl[1:])
        # Absolute positions of every new token, then their slots through the block table.
        req_of_token = torch.repeat_interleave(torch.arange(q.shape[0]), q.long())
        pos = (torch.arange(int(qsl[-1])) - qsl[:-1].long()[req_of_token]) + (s - q).long()[req_of_token]
        blocks = bt_cpu.long()[req_of_token, pos // block_size]
        slots = blocks * block_size + pos % block_size
        dev = torch.device(device)
        return AttentionMetadata(
            num_reqs=int(q.shape[0]),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=int(q.max()) if q.numel() else 0,
            max_seq_len=int(s.max()) if s.numel() else 0,
            query_start_loc=qsl.to(dev),
            seq_lens=s.to(dev),
            block_table=bt_cpu.to(dev),
            slot_mapping=slots.to(dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=s,
        )
