"""The ragged prefill kernel (`pagedserve_triton.ragged_prefill`) through the Triton backend, run on
CPU tensors by Triton's interpreter: prompt-only batches take it once `enable_new_kv_reads` is
on, its output matches the cpu_reference oracle, and every other batch stays on the unified
kernels. Shapes are tiny because the interpreter is slow.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

# The interpreter must be chosen before triton (and the kernels) are imported.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.tuned_configs import TunedConfigError, TunedConfigFile, TunedConfigs
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.launch_params import LaunchParams
from pagedserve_triton.ragged_prefill import (
    MIN_QUERY_LEN,
    RaggedPrefillLaunch,
    plan_tiles,
    ragged_prefill_kernel,
    unsupported_reason,
)

if not isinstance(ragged_prefill_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}
HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 32, 16


@dataclass(frozen=True)
class Batch:
    query: torch.Tensor  # [num_tokens + padding, HEADS, HEAD_SIZE]
    kv_cache: torch.Tensor  # [2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE]
    metadata: AttentionMetadata
    new_key: torch.Tensor  # [num_tokens + padding, KV_HEADS, HEAD_SIZE]: the cache's new rows
    new_value: torch.Tensor


def make_batch(query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, padding: int = 3) -> Batch:
    """Shuffled blocks, NaN in every cache slot no request owns and in the padding rows of the
    query and of the new keys and values, so that any read outside a request poisons the output."""
    gen = torch.Generator().manual_seed(sum(query_lens) + len(seq_lens))
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(need) + 2
    kv_cache = torch.full((2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE), float("nan"), dtype=dtype)
    ids = torch.randperm(num_blocks, generator=gen)[: sum(need)].int()
    table = torch.zeros(len(need), max(need) + 1, dtype=torch.int32)
    used = 0
    for i, (n, s) in enumerate(zip(need, seq_lens, strict=True)):
        table[i, :n] = ids[used : used + n]
        data = torch.randn(2, n * BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen)
        data[:, s:] = float("nan")
        kv_cache[:, table[i, :n].long()] = data.reshape(2, n, BLOCK_SIZE, KV_HEADS, HEAD_SIZE).to(dtype)
        used += n
    metadata = AttentionMetadata.build(query_lens, seq_lens, table, BLOCK_SIZE)
    rows = metadata.num_actual_tokens
    query = torch.randn(rows + padding, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    query[rows:] = float("nan")
    flat = kv_cache.reshape(2, -1, KV_HEADS, HEAD_SIZE)
    new_kv = torch.full((2, rows + padding, KV_HEADS, HEAD_SIZE), float("nan"), dtype=dtype)
    new_kv[:, :rows] = flat[:, metadata.slot_mapping]
    return Batch(query, kv_cache, metadata, new_kv[0], new_kv[1])


def ragged_backend() -> TritonUnifiedAttentionBackend:
    backend = TritonUnifiedAttentionBackend()
    assert backend.enable_new_kv_reads()
    return backend


def ragged_forward(batch: Batch, *, value_factor: float = 1.0) -> torch.Tensor:
    """The backend as the engine calls it, with the new values scaled by `value_factor`."""
    return ragged_backend().forward(
        batch.query,
        batch.kv_cache,
        batch.metadata,
        scale=HEAD_SIZE**-0.5,
        new_key=batch.new_key,
        new_value=batch.new_value * value_factor,
    )


def oracle(batch: Batch) -> torch.Tensor:
    rows = batch.metadata.num_actual_tokens
    out = ReferenceAttentionBackend().forward(
        batch.query[:rows].float(), batch.kv_cache.float(), batch.metadata, scale=HEAD_SIZE**-0.5
    )
    return out


CASES = {
    "one prompt, partial last tile": ([37], [37]),
    "prompts of mixed lengths": ([16, 70, 19], [16, 70, 19]),
    "chunks after cached context": ([20, 33], [20 + 45, 33 + 6]),
    "prompt beside a chunk": ([24, 17], [24, 17 + 64]),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_oracle(name: str, dtype: torch.dtype) -> None:
    query_lens, seq_lens = CASES[name]
    batch = make_batch(query_lens, seq_lens, dtype)
    reason = unsupported_reason(
        batch.query,
        batch.kv_cache,
        batch.metadata,
        batch.new_key,
        batch.new_value,
        sliding_window=None,
        logit_softcap=None,
    )
    assert reason is None
    out = ragged_forward(batch)
    rows = batch.metadata.num_actual_tokens
    torch.testing.assert_close(out[:rows].float(), oracle(batch), atol=TOLERANCE[dtype], rtol=0)


def test_reads_the_new_keys_and_values_not_the_cache() -> None:
    """Different new keys and values than the cache holds change the output: the kernel reads
    them (the engine passes exactly what it has just written, so both agree there)."""
    batch = make_batch([40], [40], torch.float16)
    same = ragged_forward(batch)
    other = ragged_forward(batch, value_factor=2.0)
    rows = batch.metadata.num_actual_tokens
    torch.testing.assert_close(other[:rows], same[:rows] * 2, atol=8e-3, rtol=1e-2)


def test_without_enable_the_new_keys_are_ignored() -> None:
    """A backend not asked (`enable_new_kv_reads`) reads the cache whatever it is passed."""
    batch = make_batch([40], [40], torch.float16)
    scale = HEAD_SIZE**-0.5
    out = TritonUnifiedAttentionBackend().forward(
        batch.query,
        batch.kv_cache,
        batch.metadata,
        scale=scale,
        new_key=batch.new_key * 0,
        new_value=batch.new_value * 0,
    )
    rows = batch.metadata.num_actual_tokens
    torch.testing.assert_close(out[:rows].float(), oracle(batch), atol=TOLERANCE[torch.float16], rtol=0)


def _reason(batch: Batch, **overrides: object) -> str | None:
    args: dict[str, object] = dict(
        query=batch.query,
        kv_cache=batch.kv_cache,
        metadata=batch.metadata,
        new_key=batch.new_key,
        new_value=batch.new_value,
        sliding_window=None,
        logit_softcap=None,
    )
    args.update(overrides)
    return unsupported_reason(**args)  # type: ignore[arg-type]


def test_other_batches_stay_on_the_unified_kernels() -> None:
    batch = make_batch([20, 16], [20, 30], torch.float16)
    assert _reason(batch) is None
    decode = make_batch([1, 20], [9, 20], torch.float16)
    assert "shorter than" in (_reason(decode) or "")
    assert "window" in (_reason(batch, sliding_window=8) or "")
    assert "softcap" in (_reason(batch, logit_softcap=30.0) or "")
    fp8 = batch.kv_cache.to(torch.float8_e4m3fn)
    assert "unquantized" in (_reason(batch, kv_cache=fp8) or "")
    unpacked = batch.new_key.transpose(1, 2).contiguous().transpose(1, 2)
    assert "packed rows" in (_reason(batch, new_key=unpacked) or "")
    misaligned = torch.empty(batch.new_value.numel() + 1, dtype=torch.float16)[1:].view_as(batch.new_value)
    assert "aligned" in (_reason(batch, new_value=misaligned) or "")
    short = batch.new_key[:10]
    assert "shape" in (_reason(batch, new_key=short) or "")
    wide = make_batch([20, 16], [20, 30], torch.float16)
    odd_heads = wide.query[:, :, :24]
    assert "power of two" in (_reason(wide, query=odd_heads) or "")


def test_a_decode_batch_with_new_keys_matches_the_oracle() -> None:
    """Batches the ragged kernel does not take still compute the right thing with the keywords."""
    batch = make_batch([1, 3, 20], [9, 12, 20], torch.float16)
    out = ragged_forward(batch)
    rows = batch.metadata.num_actual_tokens
    torch.testing.assert_close(out[:rows].float(), oracle(batch), atol=TOLERANCE[torch.float16], rtol=0)


def test_tiles_cover_every_query_once_longest_range_first() -> None:
    qsl = torch.tensor([0, 130, 150, 350], dtype=torch.int32)  # query lens 130, 20, 200
    seq_lens = torch.tensor([130, 1020, 200], dtype=torch.int32)  # the second has 1000 of context
    request, index = plan_tiles(qsl, seq_lens, 64)
    assert sorted(zip(request.tolist(), index.tolist(), strict=True)) == [
        (0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1), (2, 2), (2, 3),
    ]  # fmt: skip
    pairs = zip(request.tolist(), index.tolist(), strict=True)
    keys = [int(seq_lens[r] - (qsl[r + 1] - qsl[r])) + (i + 1) * 64 for r, i in pairs]
    assert keys == sorted(keys, reverse=True)
    assert (request[0].item(), index[0].item()) == (1, 0)  # 1000 cached keys + its chunk


def _file(params: dict[str, object]) -> TunedConfigs:
    content = TunedConfigFile.model_validate(
        {
            "schema_version": 1,
            "kernel": "ragged_prefill",
            "device": "default",
            "configs": [{"match": {}, "params": params}],
        }
    )
    return TunedConfigs([(Path("test.json"), content)])


def test_launch_params() -> None:
    shipped = LaunchParams()

    def lookup(has_context: bool, max_query_len: int) -> tuple[str, int, int, bool, int | None]:
        c = shipped.ragged_prefill(
            "h100", head_size=128, dtype=torch.bfloat16, has_context=has_context, max_query_len=max_query_len
        )
        return c.kernel, c.block_m, c.block_n, c.prefetch_block_ids, c.maxnreg

    assert lookup(False, 64) == ("gluon_sm90", 64, 32, False, None)
    assert lookup(False, 512) == ("gluon_sm90", 64, 32, False, None)
    assert lookup(True, 40) == ("triton", 64, 64, True, None)
    assert lookup(False, 2048) == ("gluon_sm90", 64, 64, False, None)
    assert lookup(False, 4097) == ("triton", 128, 128, False, None)  # the bucket of 8192
    assert lookup(True, 1024) == ("triton", 128, 64, True, 128)
    bad = LaunchParams(_file({"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}))
    with pytest.raises(TunedConfigError, match="must divide BLOCK_M"):
        bad.ragged_prefill("h100", head_size=128, dtype=torch.bfloat16, has_context=False, max_query_len=64)
    for maxnreg in (8, 256, "128", True):
        params = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "maxnreg": maxnreg}
        with pytest.raises(TunedConfigError, match="maxnreg"):
            LaunchParams(_file(params)).ragged_prefill(
                "h100", head_size=128, dtype=torch.bfloat16, has_context=False, max_query_len=64
            )


@pytest.mark.parametrize(
    ("params", "has_context", "message"),
    [
        ({"KERNEL": "flash"}, False, "must be one of"),
        ({"KERNEL": "gluon_sm90"}, True, "reads no cached context"),
        ({"KERNEL": "gluon_sm90", "BLOCK_M": 128, "num_warps": 8}, False, "BLOCK_M=64 on 4 warps"),
        ({"KERNEL": "gluon_sm90", "num_stages": 1}, False, "num_stages >= 2"),
        ({"KERNEL": "gluon_sm90", "maxnreg": 128}, False, "no maxnreg"),
    ],
)
def test_gluon_sm90_entries_are_checked(params: dict[str, object], has_context: bool, message: str) -> None:
    full = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2, **params}
    with pytest.raises(TunedConfigError, match=message):
        LaunchParams(_file(full)).ragged_prefill(
            "h100", head_size=128, dtype=torch.bfloat16, has_context=has_context, max_query_len=512
        )


def test_gluon_sm90_entry_runs_the_triton_kernel_off_hopper() -> None:
    """A "gluon_sm90" entry on a device without sm_90 (here the interpreter's CPU) launches the
    Triton kernel with the entry's tile sizes, and its output matches the oracle."""
    batch = make_batch([40, 70], [40, 70], dtype=torch.float16)
    config = LaunchParams(
        _file({"KERNEL": "gluon_sm90", "BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2})
    ).ragged_prefill("cpu", head_size=HEAD_SIZE, dtype=torch.float16, has_context=False, max_query_len=70)
    scale = HEAD_SIZE**-0.5
    launch = RaggedPrefillLaunch.build(batch.query, batch.metadata, config, scale=scale, has_context=False)
    assert config.kernel == "gluon_sm90" and not launch.on_sm90
    out = torch.zeros_like(batch.query)
    launch(out, batch.query, batch.new_key, batch.new_value, batch.kv_cache)
    rows = batch.metadata.num_actual_tokens
    torch.testing.assert_close(out[:rows].float(), oracle(batch), atol=TOLERANCE[torch.float16], rtol=0)

    assert MIN_QUERY_LEN >= 2
