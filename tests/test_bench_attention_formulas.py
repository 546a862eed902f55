"""The arithmetic of `benchmarks/kernel_benchmarks/attention.py --table` (`attention_cases.py`): needed K/V
bytes, causal FLOPs, the case table and its goals; and the baselines' layouts and masks
(`attention_baselines.py`), the bottom-right causal mask handed to cuDNN among them.
Hand-computed small cases; no GPU, no kernel launches."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# The modules import the Triton kernels. Like tests/test_triton_attention.py, choose the
# interpreter before they are defined, so whichever test module a pytest process imports first,
# the kernels in that process stay runnable on CPU for the other.
os.environ["TRITON_INTERPRET"] = "1"
# The kernel scripts import their neighbours by file name, as when run from their folder.
sys.path.insert(0, str(ROOT / "plugins" / "triton"))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernel_benchmarks"))
import attention_baselines as baselines  # noqa: E402
import attention_batches as batches  # noqa: E402
import attention_cases as case_table  # noqa: E402
from attention_cases import Target, target_met  # noqa: E402


def test_needed_kv_bytes_counts_every_token_of_k_and_v_once() -> None:
    # (3 + 5) tokens * 2 kv heads * head 4 * (K and V) * 2 bytes (bf16)
    assert case_table.needed_kv_bytes([3, 5], kv_heads=2, head_size=4, dtype_bytes=2) == 8 * 2 * 4 * 2 * 2
    assert case_table.needed_kv_bytes([7], kv_heads=1, head_size=1, dtype_bytes=4) == 7 * 2 * 4


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "keys_seen"),
    [
        ([3], [3], 1 + 2 + 3),  # full prefill: row j sees j + 1 keys
        ([1], [5], 5),  # decode sees its whole sequence
        ([2], [5], 4 + 5),  # chunk of 2 after a 3-token context
        ([1, 1, 2], [4, 6, 2], 4 + 6 + (1 + 2)),  # ragged mix
    ],
)
def test_causal_flops_by_hand(query_lens: list[int], seq_lens: list[int], keys_seen: int) -> None:
    # 4 FLOPs per (key, head, head dim): QK^T and PV, a multiply-add counted as 2.
    assert case_table.causal_flops(query_lens, seq_lens, q_heads=2, head_size=8) == keys_seen * 2 * 8 * 4


@pytest.mark.parametrize(("query_len", "seq_len"), [(1, 1), (1, 7), (3, 3), (2, 5), (4, 9)])
def test_lower_right_mask_agrees_with_the_flop_count(query_len: int, seq_len: int) -> None:
    mask = baselines.lower_right_mask(query_len, seq_len, torch.device("cpu"))
    assert mask.shape == (query_len, seq_len)
    assert int(mask.sum()) * 4 == case_table.causal_flops([query_len], [seq_len], q_heads=1, head_size=1)
    assert bool(mask[-1].all()), "the last query row is the newest token: it sees every key"


def test_lower_right_mask_is_bottom_right_aligned() -> None:
    mask = baselines.lower_right_mask(2, 5, torch.device("cpu"))
    assert mask.int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_table_case_sizes_at_full_scale() -> None:
    prefill = 4 * 2048 * 2049 // 2 * 32 * 128 * 4
    assert case_table.causal_flops([2048] * 4, [2048] * 4, 32, 128) == prefill == 137_506_062_336
    chunk = (1024 * 7168 + 1024 * 1025 // 2) * 32 * 128 * 4
    assert case_table.causal_flops([1024], [8192], 32, 128) == chunk
    assert case_table.needed_kv_bytes([2048] * 64, 8, 128, 2) == 64 * 2048 * 8 * 128 * 2 * 2 == 536_870_912


def test_case_table_is_the_documented_list() -> None:
    cases = {c.name: c for c in case_table.table_cases(case_table.TableSizes())}
    decodes = {f"decode b{b} ctx{c}" for b in (1, 16, 64, 256) for c in (512, 2048, 8192)}
    assert decodes <= set(cases)
    assert len(cases) == 12 + 4
    assert cases["decode b256 ctx8192"].query_lens == [1] * 256
    assert cases["decode b256 ctx8192"].seq_lens == [8192] * 256
    assert cases["prefill 4x2048"].query_lens == cases["prefill 4x2048"].seq_lens == [2048] * 4
    assert (cases["chunked q1024 ctx7168"].query_lens, cases["chunked q1024 ctx7168"].seq_lens) == (
        [1024],
        [8192],
    )
    mixed = cases["mixed 64x2048 + 2x1024"]
    assert mixed.query_lens == [1] * 64 + [1024] * 2
    assert mixed.seq_lens == [2048] * 64 + [1024] * 2
    spec = cases["spec b64 q4 ctx2048"]
    assert (spec.query_lens, spec.seq_lens) == ([4] * 64, [2048] * 64)
    # Every reference number names a case that runs.
    assert set(case_table.VLLM_REFERENCE_US) <= set(cases)


def test_case_targets() -> None:
    cases = {c.name: c for c in case_table.table_cases(case_table.TableSizes())}

    def target(name: str, q_heads: int = 32) -> object:
        return case_table.case_target(cases[name], q_heads, 8)

    assert target("decode b64 ctx2048") == Target("gbps", 2700.0)
    assert target("decode b256 ctx8192") == Target("gbps", 2700.0)
    assert target("decode b64 ctx512") is None
    assert target("decode b1 ctx8192") == Target("us", 25.0)
    assert target("decode b16 ctx2048") == Target("us", 45.0)
    assert target("decode b16 ctx512") is None
    assert target("prefill 4x2048") == Target("tflops", 450.0, beat_flex=True)
    assert target("chunked q1024 ctx7168") == Target("tflops", 400.0, beat_flex=True)
    assert target("mixed 64x2048 + 2x1024") == Target("us", 300.0)
    assert target("spec b64 q4 ctx2048") == Target("us", 170.0)
    assert target("prefill 4x2048", q_heads=64) is None  # targets are stated for 32q/8kv only


def test_target_met() -> None:
    prefill = Target("tflops", 350.0, beat_flex=True)
    assert target_met(prefill, us=390.0, gbps=0.0, tflops=352.0, flex_us=400.0)
    assert not target_met(prefill, us=390.0, gbps=0.0, tflops=352.0, flex_us=380.0)  # Flex faster
    assert not target_met(prefill, us=500.0, gbps=0.0, tflops=275.0, flex_us=None)
    assert target_met(prefill, us=390.0, gbps=0.0, tflops=352.0, flex_us=None)
    assert target_met(Target("us", 300.0), us=299.0, gbps=0.0, tflops=0.0, flex_us=None)
    assert not target_met(Target("us", 300.0), us=301.0, gbps=0.0, tflops=0.0, flex_us=None)
    assert not target_met(Target("gbps", 2700.0), us=1.0, gbps=2600.0, tflops=0.0, flex_us=1.0)


def _reference(batch: Any, q_heads: int, kv_heads: int) -> torch.Tensor:
    """Float64 attention of every request over its contiguous K/V with a bottom-right causal mask."""
    outs = []
    starts = batch.metadata.query_start_loc_cpu.tolist()
    for i, (ql, sl) in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        # Token by token through the block table, independent of the benchmark's gathers.
        bs = batch.kv_cache.shape[2]
        table = batch.metadata.block_table.cpu()
        slots = [(int(table[i, pos // bs]), pos % bs) for pos in range(sl)]
        k = torch.stack([batch.kv_cache[0, b, o] for b, o in slots], dim=1)  # [kv_heads, sl, head]
        v = torch.stack([batch.kv_cache[1, b, o] for b, o in slots], dim=1)
        q = batch.query[starts[i] : starts[i] + ql].transpose(0, 1).double()
        k = k.double().repeat_interleave(q_heads // kv_heads, 0)
        v = v.double().repeat_interleave(q_heads // kv_heads, 0)
        scores = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~baselines.lower_right_mask(ql, sl, torch.device("cpu")), float("-inf"))
        outs.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([1, 1, 1], [20, 20, 20]),  # decodes
        ([3, 3], [3, 3]),  # prefills
        ([5], [21]),  # chunked prefill: bottom-right causal
        ([2, 2], [9, 9]),  # speculative
        ([1, 1, 6, 6], [17, 17, 6, 6]),  # mixed: Flex runs it concatenated with a document mask
    ],
)
def test_flex_and_sdpa_layouts_and_masks_match_a_reference(
    query_lens: list[int], seq_lens: list[int]
) -> None:
    shape = batches.Shape(q_heads=4, kv_heads=2, head_size=16, block_size=16, dtype=torch.float32)
    batch = batches.make_batch(shape, query_lens, seq_lens, device="cpu")
    groups = baselines.make_groups(batch)
    assert len(groups) == len(set(zip(query_lens, seq_lens, strict=True)))
    reference = _reference(batch, 4, 2)
    built = baselines.flex_builder(batch, groups, compiled=False)()
    torch.testing.assert_close(built.to_rows(built.fn()).double(), reference, atol=1e-4, rtol=1e-4)
    if all(ql in (1, sl) for ql, sl in zip(query_lens, seq_lens, strict=True)):
        # SDPA's flash backend has a CPU kernel for no-mask and is_causal calls (not for offsets).
        built = baselines.sdpa_builder(batch, groups, "flash")()
        torch.testing.assert_close(built.to_rows(built.fn()).double(), reference, atol=1e-4, rtol=1e-4)
