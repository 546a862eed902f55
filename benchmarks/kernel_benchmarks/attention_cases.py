"""The case table of `attention.py --table` (and the cases `--variants` times): the cases at full
size and shrunk for the CPU, the goal of each, vLLM's reference times, and the arithmetic a case's
rates come from (the K/V bytes it must read, its causal FLOPs). No GPU, nothing timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Target:
    """The goal of one 32q/8kv case of the table: `metric` must be <= `bound` ("us") or >= it."""

    metric: Literal["us", "gbps", "tflops"]
    bound: float
    # Prefill targets also ask for at least FlexAttention's speed measured in the same run.
    beat_flex: bool = False

    def describe(self) -> str:
        op = "<=" if self.metric == "us" else ">="
        unit = {"us": " us", "gbps": " GB/s", "tflops": " TFLOP/s"}[self.metric]
        return f"{op} {self.bound:g}{unit}" + (" and <= flex" if self.beat_flex else "")


@dataclass(frozen=True, slots=True)
class TableCase:
    name: str
    kind: Literal["decode", "prefill", "chunked", "mixed", "spec"]
    query_lens: list[int]  # req index -> query_len
    seq_lens: list[int]  # req index -> seq_len (context + new tokens)


@dataclass(frozen=True, slots=True)
class TableSizes:
    """The lengths of the table's cases; `--smoke` shrinks them so Triton's interpreter can run them."""

    decode_batches: tuple[int, ...] = (1, 16, 64, 256)
    decode_contexts: tuple[int, ...] = (512, 2048, 8192)
    prefill: tuple[int, int] = (4, 2048)  # (requests, tokens each)
    chunked: tuple[int, int] = (1024, 7168)  # (new tokens, context already cached)
    mixed: tuple[int, int, int, int] = (64, 2048, 2, 1024)  # (decodes, their ctx, prefills, their len)
    spec: tuple[int, int, int] = (64, 4, 2048)  # (requests, query_len, ctx)


SMOKE_SIZES = TableSizes(
    decode_batches=(1, 3),
    decode_contexts=(24, 72),
    prefill=(2, 40),
    chunked=(24, 40),
    mixed=(3, 40, 2, 24),
    spec=(3, 4, 40),
)

# vLLM's Triton unified attention on an H100 80GB HBM3 (2026-11-22), 32q/8kv, CUDA-graph timed (us), with the
# other baselines measured there; printed beside ours, never used to judge a target.
VLLM_REFERENCE_US: dict[str, float] = {
    "decode b1 ctx8192": 42.5,
    "decode b16 ctx2048": 68.0,
    "decode b64 ctx2048": 188.0,
    "decode b256 ctx8192": 2890.0,
    "prefill 4x2048": 1920.0,
    "chunked q1024 ctx7168": 1800.0,
    "mixed 64x2048 + 2x1024": 430.0,
    "spec b64 q4 ctx2048": 190.0,
}
REFERENCE_NOTES = "vLLM run also measured: prefill 4x2048 cuDNN SDPA 296 us, flex 414 us; chunked flex 324 us"


def table_cases(sizes: TableSizes) -> list[TableCase]:
    """The table's cases, longest-compiling baselines (prefills) first so a Flex budget cut hits
    decodes last. Pure."""
    n_pre, len_pre = sizes.prefill
    q_chunk, ctx_chunk = sizes.chunked
    n_dec, ctx_dec, n_mix_pre, len_mix_pre = sizes.mixed
    n_spec, q_spec, ctx_spec = sizes.spec
    cases = [
        TableCase(f"prefill {n_pre}x{len_pre}", "prefill", [len_pre] * n_pre, [len_pre] * n_pre),
        TableCase(f"chunked q{q_chunk} ctx{ctx_chunk}", "chunked", [q_chunk], [q_chunk + ctx_chunk]),
        TableCase(
            f"mixed {n_dec}x{ctx_dec} + {n_mix_pre}x{len_mix_pre}",
            "mixed",
            [1] * n_dec + [len_mix_pre] * n_mix_pre,
            [ctx_dec] * n_dec + [len_mix_pre] * n_mix_pre,
        ),
        TableCase(f"spec b{n_spec} q{q_spec} ctx{ctx_spec}", "spec", [q_spec] * n_spec, [ctx_spec] * n_spec),
    ]
    cases += [
        TableCase(f"decode b{b} ctx{c}", "decode", [1] * b, [c] * b)
        for b in sizes.decode_batches
        for c in sizes.decode_contexts
    ]
    return cases


def case_target(case: TableCase, q_heads: int, kv_heads: int) -> Target | None:
    """The goal of this case, or None (goals are stated for 32q/8kv only). Pure."""
    if (q_heads, kv_heads) != (32, 8):
        return None
    if case.kind == "prefill":
        return Target("tflops", 450.0, beat_flex=True)
    if case.kind == "chunked":
        return Target("tflops", 400.0, beat_flex=True)
    if case.kind == "mixed":
        return Target("us", 300.0)
    if case.kind == "spec":
        return Target("us", 170.0)
    batch, ctx = len(case.seq_lens), case.seq_lens[0]
    if batch >= 64 and ctx >= 2048:
        return Target("gbps", 2700.0)
    return {(1, 8192): Target("us", 25.0), (16, 2048): Target("us", 45.0)}.get((batch, ctx))


def needed_kv_bytes(seq_lens: list[int], kv_heads: int, head_size: int, dtype_bytes: int) -> int:
    """Bytes of K and V the batch must read at least once: every request's seq_len tokens. Pure."""
    return sum(seq_lens) * kv_heads * head_size * 2 * dtype_bytes


def causal_flops(query_lens: list[int], seq_lens: list[int], q_heads: int, head_size: int) -> int:
    """FLOPs of causal attention: a request's query rows are its last query_len tokens, so row j
    (0-based) sees `seq_len - query_len + j + 1` keys; each key costs q_heads * head_size * 4
    (QK^T and PV, a multiply-add counted as 2). Pure."""
    total = 0
    for q, s in zip(query_lens, seq_lens, strict=True):
        keys_seen = q * (s - q) + q * (q + 1) // 2
        total += keys_seen * q_heads * head_size * 4
    return total


def target_met(target: Target, us: float, gbps: float, tflops: float, flex_us: float | None) -> bool:
    """Whether a measurement meets `target`; `flex_us` None means Flex was not measured, and the
    "at least Flex's speed" half of a prefill target is then not judged. Pure."""
    value = {"us": us, "gbps": gbps, "tflops": tflops}[target.metric]
    ok = value <= target.bound if target.metric == "us" else value >= target.bound
    if target.beat_flex and flex_us is not None:
        ok = ok and us <= flex_us
    return ok
