r"""Time the Triton unified attention backend on a GPU, against torch SDPA (and FlexAttention with
--flex), and optionally sweep launch parameters to write tuned-config files.

Every timing replays a CUDA graph of one layer's attention call (no launch overhead, as the engine
runs decode steps), so it measures the kernels. Block tables are shuffled. Columns: the plan the
heuristic chose, its time, the forced-2D time and, with --splits-sweep, every forced split count,
plus effective K/V bandwidth. SDPA and Flex read a contiguous (unpaged) copy of the same K/V, an
upper bound that a paged kernel cannot beat by layout alone.

    PYTHONPATH=core:plugins/triton python benchmarks/kernels/attention.py                  # decode grid
    PYTHONPATH=core:plugins/triton python benchmarks/kernels/attention.py --prefill --splits-sweep
    PYTHONPATH=core:plugins/triton python benchmarks/kernels/attention.py --tune OUT_DIR   # writes JSON

Defaults are a Llama-3-8B layer: 32 query heads, 8 KV heads, head size 128, bfloat16, block 16.

--table measures the standard case table in one run (decode b{1,16,64,256} x ctx
{512,2048,8192}; prefill 4 x 2048; chunked q1024 after 7168 tokens of context; 64 decodes at
ctx 2048 + 2 prefills of 1024; speculative b64 q4 ctx 2048), for 32q/8kv and 64q/8kv heads, against
SDPA flash, SDPA cuDNN and compiled FlexAttention on contiguous copies, with vLLM's reference
numbers and the table's goals beside them. "ctx N" of a decode or speculative request is its seq_len
(keys it sees, new tokens included). The exact command for an H100 (about 3-4 minutes):

    PYTHONPATH=core:plugins/triton python benchmarks/kernels/attention.py --table --json attention_table.json

and the CPU plumbing check (tiny shapes, Triton interpreter, timings meaningless):

    TRITON_INTERPRET=1 PYTHONPATH=core:plugins/triton python benchmarks/kernels/attention.py --table --smoke

--variants times the unified kernels' variants (`LOOP_VARIANTS`: block-id prefetching, lazy
rescaling, a per-loop pipelining depth, warp specialisation, longest-first launch order) across
`PREFILL_POINTS` (BLOCK_M, TILE_SIZE, warps, stages) on the table's prefill and chunked-prefill
cases, then the decode cases and the mixed batch as a no-regression check, in one compact table
(about 3-4 minutes on an H100, mostly compiling); --write-configs writes the winners:

    PYTHONPATH=core:plugins/triton python benchmarks/kernels/attention.py --variants \
        --write-configs plugins/triton/pagedserve_triton/configs --json variants.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms.api import KVCacheScales
from pagedserve.platforms.tuned_configs import (
    ShapeValue,
    TunedConfigFile,
    TunedConfigNotFound,
    TunedConfigs,
    device_family,
)
from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.launch_params import CONFIG_DIR, device_name_of
from pagedserve_triton.ragged_prefill import unsupported_reason as ragged_unsupported_reason

# The backend class every timing constructs; `--backend rocm` swaps in the rocm platform's.
BACKEND: list[type[TritonUnifiedAttentionBackend]] = [TritonUnifiedAttentionBackend]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class Shape:
    q_heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class Batch:
    query: torch.Tensor  # [num_tokens, q_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_size]
    metadata: AttentionMetadata
    query_lens: list[int]  # req index -> query_len
    seq_lens: list[int]  # req index -> seq_len


def make_batch(
    shape: Shape,
    query_lens: list[int],
    seq_lens: list[int],
    device: str = "cuda",
    kv_cache_dtype: torch.dtype | None = None,  # an FP8 cache (scales 1: randn fits e4m3/e5m2)
) -> Batch:
    """Random data in a cache whose blocks are handed out in shuffled order. Does not mutate."""
    gen = torch.Generator(device=device).manual_seed(0)
    need = [-(-s // shape.block_size) for s in seq_lens]
    num_blocks = sum(need)
    kv = torch.randn(
        2,
        num_blocks,
        shape.block_size,
        shape.kv_heads,
        shape.head_size,
        device=device,
        dtype=shape.dtype,
        generator=gen,
    )
    if kv_cache_dtype is not None:
        kv = kv.to(kv_cache_dtype)
    ids = torch.randperm(num_blocks, device=device, generator=gen).int()
    table = torch.zeros(len(need), max(need), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[used : used + n]
        used += n
    md = AttentionMetadata.build(query_lens, seq_lens, table, shape.block_size, device=device)
    q = torch.randn(
        md.num_actual_tokens, shape.q_heads, shape.head_size, device=device, dtype=shape.dtype, generator=gen
    )
    return Batch(q, kv, md, query_lens, seq_lens)


KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {  # --kv-cache-dtype -> cache dtype (None: --dtype)
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def time_graph(fn: Callable[[], object], iters: int = 50) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph (median of 5 rounds)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(rounds)[2]


def triton_time(batch: Batch, num_splits: int | None, configs: TunedConfigs | None = None) -> float:
    backend = BACKEND[0](num_splits=num_splits, tuned_configs=configs)
    out = torch.empty_like(batch.query)
    scale = batch.query.shape[-1] ** -0.5
    # An FP8 cache (made by make_batch with scales 1) reads with its scales; otherwise none.
    kv_scales = KVCacheScales(1.0, 1.0) if batch.kv_cache.dtype != batch.query.dtype else None
    return time_graph(
        lambda: backend.forward(
            batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out, kv_scales=kv_scales
        )
    )


def contiguous_kv(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [num_reqs, kv_heads, max_seq_len, head_size] (all requests must share seq_len)."""
    bt = batch.metadata.block_table.long()
    _, _, _, hkv, d = batch.kv_cache.shape
    seq = batch.seq_lens[0]
    k = batch.kv_cache[0][bt].reshape(bt.shape[0], -1, hkv, d)[:, :seq].transpose(1, 2).contiguous()
    v = batch.kv_cache[1][bt].reshape(bt.shape[0], -1, hkv, d)[:, :seq].transpose(1, 2).contiguous()
    return k, v


def sdpa_time(batch: Batch) -> float:
    k, v = contiguous_kv(batch)
    b, ql = len(batch.query_lens), batch.query_lens[0]
    q = batch.query.reshape(b, ql, -1, batch.query.shape[-1]).transpose(1, 2).contiguous()
    causal = ql > 1 and ql == batch.seq_lens[0]
    return time_graph(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))


def flex_time(batch: Batch) -> float:
    from torch.nn.attention.flex_attention import flex_attention

    k, v = contiguous_kv(batch)
    b, ql = len(batch.query_lens), batch.query_lens[0]
    q = batch.query.reshape(b, ql, -1, batch.query.shape[-1]).transpose(1, 2).contiguous()
    compiled = torch.compile(flex_attention, dynamic=False)
    return time_graph(lambda: compiled(q, k, v, enable_gqa=True))


def kv_bytes(batch: Batch) -> int:
    _, _, _, hkv, d = batch.kv_cache.shape
    return 2 * sum(batch.seq_lens) * hkv * d * batch.kv_cache.element_size()


def plan_of(batch: Batch) -> str:
    _, hq, d = batch.query.shape
    _, _, bs, hkv, _ = batch.kv_cache.shape
    plan = BACKEND[0]().plan(
        batch.metadata,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_size=d,
        block_size=bs,
        dtype=batch.query.dtype,
        device=batch.query.device,
    )
    return plan.kind if plan.kind == "2d" else f"3d/{plan.num_splits}"


def run_grid(shape: Shape, cases: list[tuple[str, list[int], list[int]]], args: argparse.Namespace) -> None:
    sweep = [2, 4, 8, 16, 32, 64] if args.splits_sweep else []
    head = f"{'case':<28}{'plan':>7}{'heur us':>9}{'2d us':>9}" + "".join(
        f"{'3d/' + str(s):>8}" for s in sweep
    )
    head += f"{'GB/s':>8}{'sdpa us':>9}" + (f"{'flex us':>9}" if args.flex else "")
    print(head)
    kv_dtype = KV_CACHE_DTYPES[args.kv_cache_dtype]
    for name, qlens, slens in cases:
        batch = make_batch(shape, qlens, slens, kv_cache_dtype=kv_dtype)
        heur = triton_time(batch, None)
        row = f"{name:<28}{plan_of(batch):>7}{heur:>9.1f}{triton_time(batch, 1):>9.1f}"
        can_split = max(qlens) <= 16
        row += "".join(f"{triton_time(batch, s) if can_split else float('nan'):>8.1f}" for s in sweep)
        row += f"{kv_bytes(batch) / heur / 1e3:>8.0f}"
        # SDPA reads no FP8: with an FP8 cache its column is left out.
        row += f"{sdpa_time(batch):>9.1f}" if args.sdpa and kv_dtype is None else f"{'-':>9}"
        if args.flex:
            try:
                row += f"{flex_time(batch):>9.1f}"
            except Exception as e:  # Flex support varies by torch version; say why, keep going
                row += f"  flex failed: {type(e).__name__}: {str(e)[:60]}"
        print(row, flush=True)
        del batch
        torch.cuda.empty_cache()


def _config_file(kernel: str, family: str, entries: list[dict[str, object]]) -> dict[str, object]:
    content = {"schema_version": 1, "kernel": kernel, "device": family, "configs": entries}
    TunedConfigFile.model_validate(content)  # never write a file the loader would refuse
    return content


def configs_with_point(kernel: str, params: dict[str, Any]) -> TunedConfigs:
    """The shipped tuned configs, except that `kernel` gets only `params`: one point of a sweep,
    the other kernels on their shipped configs."""
    content = _config_file(kernel, "default", [{"params": params}])
    files = [(Path(f"<sweep {kernel}>"), TunedConfigFile.model_validate(content))]
    others = [p for p in sorted(CONFIG_DIR.glob("*.json")) if not p.name.startswith(kernel + "-")]
    files += [(p, TunedConfigFile.model_validate_json(p.read_text())) for p in others]
    return TunedConfigs(files)


def tune(shape: Shape, out_dir: Path) -> None:
    """Sweep 2D params on a decode class and a prefill class, 3D params on a long decode, and write
    `<kernel>-<family>.json` with entries for this head size ahead of the default file's entries."""
    family = device_family(torch.cuda.get_device_name())
    grid = {
        "BLOCK_M": [16, 32, 64, 128],
        "TILE_SIZE": [16, 32, 64, 128],
        "num_warps": [4, 8],
        "num_stages": [2, 3],
    }
    classes = {
        ("unified_attention_2d", "decode"): make_batch(shape, [1] * 64, [2048] * 64),
        ("unified_attention_2d", "prefill"): make_batch(shape, [2048, 512], [2048, 1024]),
        # The heuristic picks the split count (it depends on the swept TILE_SIZE): the sweep
        # must judge 3D params at the splits the engine will run them with.
        ("unified_attention_3d", "decode"): make_batch(shape, [1] * 2, [4096] * 2),
    }
    best: dict[tuple[str, str], dict[str, int]] = {}
    for (kernel, cls), batch in classes.items():
        results = []
        for values in itertools.product(*grid.values()):
            params = dict(zip(grid, values, strict=True))
            if cls == "decode" and params["BLOCK_M"] > max(16, shape.q_heads // shape.kv_heads):
                continue  # a decode tile holds one token: more rows than grouped heads are wasted
            splits = 1 if kernel.endswith("2d") else None
            try:
                t = triton_time(batch, splits, configs_with_point(kernel, params))
            except Exception as e:  # out of shared memory / registers: skip this point, say so
                print(f"  {kernel} {cls} {params}: {type(e).__name__}")
                continue
            results.append((t, params))
        results.sort(key=lambda r: r[0])
        print(f"{kernel} {cls}: best {results[0][0]:.1f} us {results[0][1]}; worst {results[-1][0]:.1f} us")
        best[(kernel, cls)] = results[0][1]
    out_dir.mkdir(parents=True, exist_ok=True)
    for kernel in ("unified_attention_2d", "unified_attention_3d"):
        default = json.loads((CONFIG_DIR / f"{kernel}-default.json").read_text())["configs"]
        entries: list[dict[str, object]] = []
        if (kernel, "decode") in best:
            entries.append(
                {
                    "match": {"head_size": shape.head_size, "max_query_len_le": 16},
                    "params": best[(kernel, "decode")],
                }
            )
        if (kernel, "prefill") in best:
            entries.append({"match": {"head_size": shape.head_size}, "params": best[(kernel, "prefill")]})
        path = out_dir / f"{kernel}-{family}.json"
        path.write_text(json.dumps(_config_file(kernel, family, entries + default), indent=2) + "\n")
        print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------
# --table: the standard case table, every backend in one run, one table.


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


@dataclass(frozen=True, slots=True)
class Group:
    """Requests sharing (query_len, seq_len), as contiguous batched copies for SDPA and Flex."""

    query_len: int
    seq_len: int
    q: torch.Tensor  # [n, q_heads, query_len, head_size]
    k: torch.Tensor  # [n, kv_heads, seq_len, head_size]
    v: torch.Tensor  # [n, kv_heads, seq_len, head_size]
    rows: torch.Tensor  # [n * query_len] int64: the flattened batch's row of each (request, position)


def contiguous_request_kv(batch: Batch, req: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request `req`'s K and V as [kv_heads, seq_len, head_size] copies out of the paged cache."""
    s = batch.seq_lens[req]
    blocks = batch.metadata.block_table[req].long()
    _, _, _, hkv, d = batch.kv_cache.shape
    k = batch.kv_cache[0][blocks].reshape(-1, hkv, d)[:s].transpose(0, 1).contiguous()
    v = batch.kv_cache[1][blocks].reshape(-1, hkv, d)[:s].transpose(0, 1).contiguous()
    return k, v


def make_groups(batch: Batch) -> list[Group]:
    """Contiguous copies of `batch`, one batched group per distinct (query_len, seq_len). Does not
    mutate `batch`."""
    starts = batch.metadata.query_start_loc_cpu.tolist()
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        by_shape.setdefault(key, []).append(i)
    _, _, _, hkv, d = batch.kv_cache.shape
    groups = []
    for (ql, sl), reqs in by_shape.items():
        rows = torch.cat([torch.arange(starts[i], starts[i] + ql) for i in reqs]).to(batch.query.device)
        q = batch.query[rows].reshape(len(reqs), ql, *batch.query.shape[1:]).transpose(1, 2).contiguous()
        # Only the blocks these requests own: [n, blocks, block, kv_heads, head] -> [n, kv_heads, sl, head]
        blocks = batch.metadata.block_table[torch.tensor(reqs, device=batch.query.device)].long()
        blocks = blocks[:, : -(-sl // batch.kv_cache.shape[2])]
        k = batch.kv_cache[0][blocks].reshape(len(reqs), -1, hkv, d)[:, :sl].transpose(1, 2).contiguous()
        v = batch.kv_cache[1][blocks].reshape(len(reqs), -1, hkv, d)[:, :sl].transpose(1, 2).contiguous()
        groups.append(Group(ql, sl, q, k, v, rows))
    return groups


def scatter_groups(batch: Batch, groups: list[Group], outs: list[torch.Tensor]) -> torch.Tensor:
    """Per-group outputs [n, q_heads, query_len, head_size] back into the batch's row order."""
    full = torch.empty_like(batch.query)
    for g, o in zip(groups, outs, strict=True):
        full[g.rows] = o.transpose(1, 2).reshape(-1, *batch.query.shape[1:])
    return full


def lower_right_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True where query row j may see key i (i <= seq_len - query_len + j)."""
    return torch.ones(query_len, seq_len, dtype=torch.bool, device=device).tril(seq_len - query_len)


@dataclass(slots=True)
class Measured:
    """One backend's result on one case: a time, or why there is none."""

    us: float | None = None
    timing: str = ""  # "graph" (CUDA-graph replay), "events" (launches timed by events) or "wall" (CPU)
    error: str | None = None
    max_diff: float | None = None  # max |out - ours| over the batch
    note: str = ""

    kv_expanded: bool = False  # GQA refused: K/V were expanded to the query heads (more bytes read)

    def cell(self, tolerance: float) -> str:
        if self.us is None:
            return f"n/a ({self.error or '?'})"
        mark = "*" if self.timing == "events" else ""
        mark += "x" if self.kv_expanded else ""
        if self.max_diff is not None and not self.max_diff <= tolerance:
            mark += "!"
        return f"{self.us:.1f}{mark}"


class Timer:
    """Times a callable: CUDA-graph replay on a GPU (falling back to CUDA events over many plain
    launches when capture fails), wall clock on CPU (`--smoke`, plumbing only)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object], m: Measured) -> None:
        """Fills `m.us` and `m.timing`; mutates only `m`."""
        if self.device.type != "cuda":
            fn()
            start = time.perf_counter()
            fn()
            m.us, m.timing = (time.perf_counter() - start) * 1e6, "wall"
            return
        try:
            m.us, m.timing = time_graph(fn), "graph"
        except Exception as e:  # some compiled or library paths refuse capture: time plain launches
            torch.cuda.synchronize()
            m.note = f"graph capture failed ({type(e).__name__}); events over launches"
            m.us, m.timing = time_events(fn), "events"


def time_events(fn: Callable[[], object], iters: int = 50) -> float:
    """Microseconds per call of `fn` from CUDA events over `iters` launches (median of 5 rounds)."""
    for _ in range(3):
        fn()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1000 / iters)
    return sorted(rounds)[2]


@dataclass(frozen=True, slots=True)
class Built:
    """A baseline ready to time: its call, the map of its output to [tokens, q_heads, head_size],
    and anything the table should say about how it ran."""

    fn: Callable[[], torch.Tensor]
    to_rows: Callable[[torch.Tensor], torch.Tensor]
    note: str = ""
    kv_expanded: bool = False


def measure(build: Callable[[], Built], ours: torch.Tensor, timer: Timer) -> Measured:
    """Build a baseline, check its output against ours, then time it. Any exception becomes "n/a"
    with its type (a backend refusing a shape is a result to report, not a crash)."""
    m = Measured()
    try:
        built = build()
        m.note, m.kv_expanded = built.note, built.kv_expanded
        m.max_diff = float((built.to_rows(built.fn()).float() - ours.float()).abs().max())
        timer(built.fn, m)
    except Exception as e:
        m.us, m.error = None, type(e).__name__
        first_line = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        m.note = f"{type(e).__name__}: {first_line}"
    return m


def sdpa_builder(batch: Batch, groups: list[Group], backend: str) -> Callable[[], Built]:
    """SDPA `backend` ("flash" or "cudnn") on the contiguous groups, one call per group: no mask
    for decodes, is_causal for full prefills. A query shorter than its sequence needs bottom-right
    causality: flash gets it from its own op (whose `is_causal` is bottom-right aligned), cuDNN
    from an explicit bool mask. K/V keep their 8 heads (`enable_gqa`); only if the backend refuses
    that are they expanded to the query heads before timing, which the table notes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION
    scale = batch.query.shape[-1] ** -0.5
    masks = {
        (g.query_len, g.seq_len): lower_right_mask(g.query_len, g.seq_len, batch.query.device)
        for g in groups
        if 1 < g.query_len < g.seq_len and backend == "cudnn"
    }

    def one(g: Group, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if 1 < g.query_len < g.seq_len and backend == "flash":
            out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
                g.q, k, v, 0.0, is_causal=True, scale=scale
            )[0]
            return out
        mask = masks.get((g.query_len, g.seq_len))
        causal = g.query_len == g.seq_len and g.query_len > 1
        with sdpa_kernel([sdp]):
            return F.scaled_dot_product_attention(
                g.q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )

    def build() -> Built:
        outs: list[torch.Tensor] = []
        kvs = [(g.k, g.v) for g in groups]

        def fn() -> torch.Tensor:
            outs[:] = [one(g, k, v) for g, (k, v) in zip(groups, kvs, strict=True)]
            return outs[0]

        note, expanded = "", False
        try:
            fn()
        except RuntimeError as e:
            group = batch.query.shape[1] // batch.kv_cache.shape[3]
            if group == 1:
                raise
            kvs[:] = [(g.k.repeat_interleave(group, 1), g.v.repeat_interleave(group, 1)) for g in groups]
            fn()  # if expanded K/V fail too, that error is the result
            note = f"GQA refused ({type(e).__name__}); K/V expanded to {batch.query.shape[1]} heads"
            expanded = True
        return Built(fn, lambda _: scatter_groups(batch, groups, outs), note, expanded)

    return build


_FLEX: dict[str, Callable[..., torch.Tensor]] = {}


def flex_fn(compiled: bool) -> Callable[..., torch.Tensor]:
    """FlexAttention, compiled once per process (shapes recompile inside dynamo's cache)."""
    key = "compiled" if compiled else "eager"
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if compiled:
            # One static-shape compile per case; dynamo's default limit (8) would silently fall
            # back to eager (dense scores) after the eighth shape.
            # (Older torch names these cache_size_limit; set whichever this version has.)
            for name, value in (
                ("recompile_limit", 256),
                ("cache_size_limit", 256),
                ("accumulated_recompile_limit", 4096),
                ("accumulated_cache_size_limit", 4096),
            ):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, value)
            _FLEX[key] = torch.compile(flex_attention, dynamic=False)
        else:
            _FLEX[key] = flex_attention
    return _FLEX[key]


def flex_builder(batch: Batch, groups: list[Group], compiled: bool) -> Callable[[], Built]:
    """FlexAttention on contiguous copies. A uniform batch runs batched with a bottom-right causal
    block mask (none for decodes); a ragged batch runs as one concatenated sequence with a
    document mask: a query sees keys of its own request at positions <= its own."""
    from torch.nn.attention.flex_attention import create_block_mask

    flex = flex_fn(compiled)
    dev = batch.query.device
    scale = batch.query.shape[-1] ** -0.5

    def build() -> Built:
        if len(groups) == 1:
            g = groups[0]
            block_mask = None
            if g.query_len > 1:
                offset = g.seq_len - g.query_len

                def offset_causal(
                    b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
                ) -> torch.Tensor:
                    return ki <= qi + offset

                block_mask = create_block_mask(offset_causal, None, None, g.query_len, g.seq_len, device=dev)

            def fn() -> torch.Tensor:
                out: torch.Tensor = flex(g.q, g.k, g.v, block_mask=block_mask, scale=scale, enable_gqa=True)
                return out

            return Built(fn, lambda o: scatter_groups(batch, groups, [o]))
        q = batch.query[: batch.metadata.num_actual_tokens].transpose(0, 1).unsqueeze(0).contiguous()
        kvs = [contiguous_request_kv(batch, i) for i in range(len(batch.seq_lens))]
        k = torch.cat([kv[0] for kv in kvs], dim=1).unsqueeze(0)
        v = torch.cat([kv[1] for kv in kvs], dim=1).unsqueeze(0)
        del kvs
        # Mask lookups are padded to Flex's 128-row blocks with document ids no real row has, so
        # a padded index never reads past a table or matches a request.
        n = len(batch.seq_lens)
        pad = 128

        def doc_table(
            lens: list[int], first_pos: list[int], pad_doc: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
            docs = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
            pos = torch.cat([torch.arange(p, p + ln) for p, ln in zip(first_pos, lens, strict=True)])
            extra = -len(docs) % pad
            docs = torch.cat([docs, torch.full((extra,), pad_doc)])
            pos = torch.cat([pos, torch.zeros(extra, dtype=torch.long)])
            return docs.to(dev), pos.to(dev)

        contexts = [s - ql for ql, s in zip(batch.query_lens, batch.seq_lens, strict=True)]
        q_doc, q_pos = doc_table(batch.query_lens, contexts, n)
        k_doc, k_pos = doc_table(batch.seq_lens, [0] * n, n + 1)

        def document_causal(
            b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
        ) -> torch.Tensor:
            return (q_doc[qi] == k_doc[ki]) & (k_pos[ki] <= q_pos[qi])

        block_mask = create_block_mask(document_causal, None, None, q.shape[2], k.shape[2], device=dev)

        def ragged() -> torch.Tensor:
            out: torch.Tensor = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
            return out

        return Built(ragged, lambda o: o[0].transpose(0, 1), "concatenated, document mask")

    return build


@dataclass(slots=True)
class CaseResult:
    case: TableCase
    q_heads: int
    kv_heads: int
    kv_bytes: int
    flops: int
    plan: str = ""
    ours: Measured = field(default_factory=Measured)
    forced_2d: Measured = field(default_factory=Measured)
    baselines: dict[str, Measured] = field(default_factory=dict)  # "flash" | "cudnn" | "flex" -> result
    target: Target | None = None
    target_met: bool | None = None
    error: str | None = None

    def rates(self, us: float | None) -> tuple[float, float]:
        """(GB/s of needed K/V bytes, TFLOP/s) at `us` microseconds; NaN when not measured."""
        if not us:
            return float("nan"), float("nan")
        return self.kv_bytes / us / 1e3, self.flops / us / 1e6

    def to_json(self) -> dict[str, object]:
        def m(x: Measured) -> dict[str, object]:
            gbps, tflops = self.rates(x.us)
            d = asdict(x)
            d.update(gbps=None if x.us is None else gbps, tflops=None if x.us is None else tflops)
            return d

        return {
            "case": self.case.name,
            "kind": self.case.kind,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "num_reqs": len(self.case.seq_lens),
            "num_tokens": sum(self.case.query_lens),
            "needed_kv_bytes": self.kv_bytes,
            "flops": self.flops,
            "plan": self.plan,
            "ours": m(self.ours),
            "ours_forced_2d": m(self.forced_2d),
            "baselines": {k: m(v) for k, v in self.baselines.items()},
            "vllm_reference_us": VLLM_REFERENCE_US.get(self.case.name) if self.q_heads == 32 else None,
            "target": None if self.target is None else self.target.describe(),
            "target_met": self.target_met,
            "error": self.error,
        }


def new_kv_of(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's new keys and values as the engine passes them beside the cache: the rows the
    cache write has just stored, contiguous [num_tokens, kv_heads, head_size]. Does not mutate."""
    _, _, _, hkv, d = batch.kv_cache.shape
    slots = batch.metadata.slot_mapping
    return (
        batch.kv_cache[0].reshape(-1, hkv, d)[slots].contiguous(),
        batch.kv_cache[1].reshape(-1, hkv, d)[slots].contiguous(),
    )


def ours_call(
    backend: TritonUnifiedAttentionBackend,
    batch: Batch,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Callable[[], torch.Tensor]:
    """One layer's attention call of `backend` on `batch`, writing a preallocated output; with
    `new_kv`, the call the engine makes (`enable_new_kv_reads` on, the step's keys and values
    passed beside the cache)."""
    out = torch.empty_like(batch.query)
    scale = batch.query.shape[-1] ** -0.5
    if new_kv is None:
        return lambda: backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out)
    backend.enable_new_kv_reads()
    key, value = new_kv
    return lambda: backend.forward(
        batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out, new_key=key, new_value=value
    )


def measure_baselines(
    res: CaseResult, batch: Batch, ours_out: torch.Tensor, timer: Timer, flex_left_s: list[float]
) -> None:
    """SDPA flash, SDPA cuDNN and Flex on contiguous copies of `batch`, into `res.baselines`.
    Mutates `res` and `flex_left_s[0]` (the Flex budget left, compile included)."""
    try:
        groups = make_groups(batch)
    except Exception as e:  # e.g. out of memory for the copies: ours is measured, baselines are not
        for name in ("flash", "cudnn", "flex"):
            res.baselines[name] = Measured(error=type(e).__name__, note=f"contiguous copies: {str(e)[:160]}")
        return
    for name in ("flash", "cudnn"):
        res.baselines[name] = measure(sdpa_builder(batch, groups, name), ours_out, timer)
    if flex_left_s[0] <= 0:
        res.baselines["flex"] = Measured(error="budget", note="skipped: --flex-budget-s spent")
        return
    start = time.perf_counter()
    compiled = batch.query.device.type == "cuda"  # CPU smoke runs Flex eagerly: no C++ compile
    res.baselines["flex"] = measure(flex_builder(batch, groups, compiled), ours_out, timer)
    flex_left_s[0] -= time.perf_counter() - start


def run_table_case(
    case: TableCase, shape: Shape, device: torch.device, timer: Timer, flex_left_s: list[float]
) -> CaseResult:
    """Measure one case: ours (heuristic plan and forced 2D), SDPA flash and cuDNN, FlexAttention.
    `flex_left_s[0]` is the remaining Flex budget (compile + timing), decremented here."""
    res = CaseResult(
        case,
        shape.q_heads,
        shape.kv_heads,
        needed_kv_bytes(case.seq_lens, shape.kv_heads, shape.head_size, shape.dtype.itemsize),
        causal_flops(case.query_lens, case.seq_lens, shape.q_heads, shape.head_size),
        target=case_target(case, shape.q_heads, shape.kv_heads),
    )
    batch = make_batch(shape, case.query_lens, case.seq_lens, device=device.type)
    scale = shape.head_size**-0.5
    res.plan = plan_of(batch)
    heuristic = BACKEND[0]()
    ours_out = heuristic.forward(batch.query, batch.kv_cache, batch.metadata, scale=scale).clone()
    new_kv = new_kv_of(batch)
    if (
        ragged_unsupported_reason(
            batch.query, batch.kv_cache, batch.metadata, *new_kv, sliding_window=None, logit_softcap=None
        )
        is None
        and BACKEND[0]().enable_new_kv_reads()
    ):
        res.plan = "ragged"
    # "ours" is the engine's call (new keys and values passed beside the cache); "2d" the
    # unified 2D kernel reading the cache only.
    for m, splits, kv in ((res.ours, None, new_kv), (res.forced_2d, 1, None)):
        call = ours_call(BACKEND[0](num_splits=splits), batch, kv)
        timer(call, m)
        m.max_diff = float((call().float() - ours_out.float()).abs().max())
    measure_baselines(res, batch, ours_out, timer, flex_left_s)
    del batch
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if res.target is not None and res.ours.us is not None:
        gbps, tflops = res.rates(res.ours.us)
        res.target_met = target_met(res.target, res.ours.us, gbps, tflops, res.baselines["flex"].us)
    return res


# (header, width); negative width = left-aligned. Widths are minimums: a baseline's error cell,
# "n/a (<exception name>)", may run past its column.
COLUMNS = [
    ("case", -23), ("heads", 5), ("plan", 5), ("ours us", 9), ("2d us", 9), ("GB/s", 6), ("TFLOP/s", 7),
    ("flash us", 21), ("cudnn us", 21), ("flex us", 21), ("vllm us", 7), ("target", -1),
]  # fmt: skip


def _row(cells: list[str]) -> str:
    """Cells under COLUMNS' widths; a FAILED row passes only its first cells."""
    widths = [w for _, w in COLUMNS[: len(cells)]]
    return " ".join(
        f"{c:<{-w}}" if w < 0 else f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)
    ).rstrip()


def print_case_table(results: list[CaseResult], tolerance: float) -> None:
    """The compact table, then the legend and every distinct note (errors, fallbacks) once."""
    head = _row([h for h, _ in COLUMNS])
    print(head)
    print("-" * len(head))
    notes: dict[str, list[str]] = {}  # message -> cases it applies to
    for r in results:
        heads = f"{r.q_heads}/{r.kv_heads}"
        if r.error is not None:
            print(f"{_row([r.case.name, heads])}  FAILED: {r.error}")
            continue
        gbps, tflops = r.rates(r.ours.us)
        ref = VLLM_REFERENCE_US.get(r.case.name) if r.q_heads == 32 else None
        target = ""
        if r.target is not None:
            verdict = "?" if r.target_met is None else ("met" if r.target_met else "MISSED")
            target = f"{verdict} ({r.target.describe()})"
        cells = [r.case.name, heads, r.plan, r.ours.cell(tolerance), r.forced_2d.cell(tolerance)]
        cells += [f"{gbps:.0f}", f"{tflops:.1f}"]
        cells += [r.baselines[k].cell(tolerance) for k in ("flash", "cudnn", "flex")]
        cells += ["" if ref is None else f"{ref:g}", target]
        print(_row(cells))
        for k, m in (("ours", r.ours), ("2d", r.forced_2d), *r.baselines.items()):
            if m.note:
                notes.setdefault(f"{k}: {m.note}", []).append(f"{r.case.name} {heads}")
    print(
        "* = timed with CUDA events over launches (graph capture failed); x = K/V expanded for GQA; "
        f"! = output differs from ours by more than {tolerance:g}.\nGB/s (needed K/V bytes) and TFLOP/s "
        "(causal) are ours with the heuristic plan; vllm us is the reference run (32q/8kv).\n"
        + REFERENCE_NOTES
    )
    for message, where in notes.items():
        print(f"  {message}  [{', '.join(where) if len(where) <= 3 else f'{len(where)} cases'}]")


def run_case_table(args: argparse.Namespace) -> None:
    """The --table mode: every case for each head configuration, then one table."""
    smoke = bool(args.smoke)
    device = torch.device("cpu" if smoke else "cuda")
    sizes = SMOKE_SIZES if smoke else TableSizes()
    # Smoke keeps the real head counts (so targets are judged) at the smallest tested head size.
    heads = [(32, 8, 32), (64, 8, 32)] if smoke else [(32, 8, 128), (64, 8, 128)]
    dtype = DTYPES[args.dtype]
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-3}[dtype]
    timer = Timer(device)
    if smoke:  # Flex runs eagerly on CPU on purpose (plumbing only): its advice to compile is noise
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    flex_left_s = [float(args.flex_budget_s)]
    results: list[CaseResult] = []
    started = time.perf_counter()
    try:
        for hq, hkv, d in heads:
            shape = Shape(hq, hkv, d, args.block_size, dtype)
            for case in table_cases(sizes):
                t0 = time.perf_counter()
                try:
                    res = run_table_case(case, shape, device, timer, flex_left_s)
                except Exception as e:  # keep going: one broken case must not cost the whole run
                    res = CaseResult(case, hq, hkv, 0, 0, error=f"{type(e).__name__}: {str(e)[:200]}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                results.append(res)
                print(
                    f"[{time.perf_counter() - t0:6.1f} s] {case.name} {hq}/{hkv}", file=sys.stderr, flush=True
                )
    finally:
        print(
            f"\n{_device_line(device)}; dtype {args.dtype}, block {args.block_size}, shuffled block tables; "
            f"total {time.perf_counter() - started:.0f} s{' (SMOKE: timings meaningless)' if smoke else ''}"
        )
        print_case_table(results, tolerance)
        if args.json is not None:
            payload = {
                "device": _device_line(device),
                "torch": torch.__version__,
                "smoke": smoke,
                "dtype": args.dtype,
                "block_size": args.block_size,
                "tolerance": tolerance,
                "reference_notes": REFERENCE_NOTES,
                "results": [r.to_json() for r in results],
            }
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
            print(f"wrote {args.json}")


# ----------------------------------------------------------------------------------------------
# --variants: the interior-loop variants of the 2D kernel x a focused launch grid, timed on the
# table's two prefill cases; then a decode (and mixed-batch) no-regression check; optionally the
# winners written into tuned-config files.

LOOP_VARIANTS: dict[str, dict[str, bool | int]] = {
    "plain": {},
    "prefetch": {"PREFETCH_BLOCK_IDS": True},
    "prefetch+longest": {"PREFETCH_BLOCK_IDS": True, "LONGEST_FIRST": True},
    "prefetch+loop3": {"PREFETCH_BLOCK_IDS": True, "LOOP_STAGES": 3},
    "pf+lazy+longest": {"PREFETCH_BLOCK_IDS": True, "LAZY_RESCALE": True, "LONGEST_FIRST": True},
    "ws": {"WARP_SPECIALIZE": True},
}
"""Name -> the variant params of `pagedserve_triton.launch_params` (WARP_SPECIALIZE is dropped
where Triton cannot warp-specialise: the row then times the other settings)."""

# (BLOCK_M, TILE_SIZE, num_warps, num_stages), most promising first: the budget cuts the tail.
# The first is the shipped H100 prefill point. Three or more stages matter with prefetching: the
# block-id load no longer feeds the K/V loads within an iteration, so Triton's pipeliner gives
# them num_stages - 1 tiles in flight instead of none (see docs/benchmarks.md).
PREFILL_POINTS: tuple[tuple[int, int, int, int], ...] = (
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (64, 64, 4, 4),
    (64, 128, 4, 3),
    (128, 128, 8, 2),
)
SMOKE_POINTS: tuple[tuple[int, int, int, int], ...] = ((16, 16, 4, 2), (32, 16, 4, 2))

# A decode variant's flags are written only if they speed the decode cases up on the whole
# (geometric mean of the time ratios below this) and slow none down by more than the limit.
DECODE_ADOPT_GEOMEAN = 0.98
DECODE_MAX_SLOWDOWN = 1.03


@dataclass(slots=True)
class VariantResult:
    """One (variant, launch point) on one group of cases: time per case, or why there is none."""

    variant: str
    params: dict[str, bool | int]  # the whole `params` of the config entry under test
    us: dict[str, float] = field(default_factory=dict)  # case name -> us
    max_diff: float = 0.0  # max |out - shipped configs' out| over the cases
    error: str | None = None


def point_params(point: tuple[int, int, int, int], flags: dict[str, bool | int]) -> dict[str, bool | int]:
    """The params of one config entry: a launch point plus variant flags. Pure."""
    block_m, tile, warps, stages = point
    return {"BLOCK_M": block_m, "TILE_SIZE": tile, "num_warps": warps, "num_stages": stages, **flags}


def configs_with(device_name: str, overrides: dict[str, list[dict[str, object]]]) -> TunedConfigs:
    """The shipped tuned configs plus, per kernel in `overrides`, a file of those entries keyed to
    the exact `device_name`, which the lookup searches before the family and default files (a
    shape no override entry matches falls through to the shipped files). Reads the shipped files."""
    files = [
        (p, TunedConfigFile.model_validate_json(p.read_text())) for p in sorted(CONFIG_DIR.glob("*.json"))
    ]
    for kernel, entries in overrides.items():
        content = {"schema_version": 1, "kernel": kernel, "device": device_name, "configs": entries}
        files.append((Path(f"<override {kernel}>"), TunedConfigFile.model_validate(content)))
    return TunedConfigs(files)


def shipped_params(kernel: str, device_name: str, shape: Shape, max_query_len: int) -> dict[str, bool | int]:
    """The shipped config params of `kernel` for this shape class (as the backend looks it up)."""
    query_bucket = 1 << (max(max_query_len, 1) - 1).bit_length()
    params = TunedConfigs.from_files(sorted(CONFIG_DIR.glob("*.json"))).lookup(
        kernel,
        device_name,
        head_size=shape.head_size,
        block_size=shape.block_size,
        num_queries_per_kv=shape.q_heads // shape.kv_heads,
        dtype=str(shape.dtype).removeprefix("torch."),
        kv_cache_dtype=str(shape.dtype).removeprefix("torch."),  # the variants' cache: the model's dtype
        max_query_len=query_bucket,
    )
    return {k: v for k, v in params.items() if isinstance(v, bool | int)}


def run_variant_group(
    name: str,
    params: dict[str, bool | int],
    cases: list[tuple[TableCase, Batch, torch.Tensor]],  # (case, batch, shipped configs' output)
    configs: TunedConfigs,
    timer: Timer,
) -> VariantResult:
    """Time every case under `configs` and compare its output with the shipped configs' output.
    A failure (compile, shared memory, launch) becomes the result's error, not an exception."""
    res = VariantResult(name, params)
    try:
        backend = BACKEND[0](tuned_configs=configs)
        for case, batch, shipped_out in cases:
            call = ours_call(backend, batch)
            m = Measured()
            timer(call, m)
            assert m.us is not None
            res.us[case.name] = m.us
            res.max_diff = max(res.max_diff, float((call().float() - shipped_out.float()).abs().max()))
    except Exception as e:  # out of shared memory, a variant this Triton cannot compile, ...
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:120] if str(e).strip() else ''}"
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return res


def _geomean(values: list[float]) -> float:
    return float(torch.tensor(values, dtype=torch.float64).log().mean().exp()) if values else float("nan")


def prefill_score(res: VariantResult, flops: dict[str, int]) -> float:
    """Geometric mean TFLOP/s over the prefill cases, `flops` (case name -> FLOPs); 0 for a failed
    or incomplete result. Pure."""
    if res.error is not None or len(res.us) != len(flops):
        return 0.0
    return _geomean([flops[c] / us / 1e6 for c, us in res.us.items()])


def decode_verdict(ratios: list[float]) -> bool:
    """Whether decode time ratios (variant / plain, one per case) justify adopting the variant for
    decodes: faster on the whole and nowhere much slower. Pure."""
    return bool(ratios) and _geomean(ratios) < DECODE_ADOPT_GEOMEAN and max(ratios) <= DECODE_MAX_SLOWDOWN


def choose_decode_flags(
    results: list[VariantResult], candidates: dict[str, dict[str, bool | int]], tolerance: float
) -> tuple[str, dict[str, bool | int]] | None:
    """The decode candidate to adopt: among those (after the first, plain, result) that ran every
    case correctly and pass `decode_verdict` against plain, the fastest by geometric mean. Pure."""
    plain, best, best_mean = results[0], None, float("inf")
    if plain.error is not None:
        return None
    for r in results[1:]:
        if r.error is not None or r.max_diff > tolerance or set(r.us) != set(plain.us):
            continue
        ratios = [r.us[c] / plain.us[c] for c in plain.us]
        if decode_verdict(ratios) and _geomean(ratios) < best_mean:
            best, best_mean = (r.variant, candidates[r.variant]), _geomean(ratios)
    return best


def replace_entry_params(
    content: dict[str, Any],
    device_name: str,
    shape_keys: dict[str, ShapeValue],
    params: dict[str, bool | int],
) -> int:
    """In a tuned-config file's `content`, replace the params of the first entry that matches
    `shape_keys` (the entry the lookup picks for that class) and return its index. Mutates
    `content`. Raises `TunedConfigNotFound` when no entry matches."""
    file = TunedConfigFile.model_validate(content)
    for index, entry in enumerate(file.configs):
        one = TunedConfigFile(schema_version=1, kernel=file.kernel, device=file.device, configs=[entry])
        try:
            TunedConfigs([(Path("<entry>"), one)]).lookup(file.kernel, device_name, **shape_keys)
        except TunedConfigNotFound:
            continue
        content["configs"][index]["params"] = dict(params)
        TunedConfigFile.model_validate(content)
        return index
    raise TunedConfigNotFound(f"no entry of {file.kernel}-{file.device} matches {shape_keys}")


def _shape_keys(shape: Shape, max_query_len: int) -> dict[str, ShapeValue]:
    return {
        "head_size": shape.head_size,
        "block_size": shape.block_size,
        "num_queries_per_kv": shape.q_heads // shape.kv_heads,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(shape.dtype).removeprefix("torch."),
        "max_query_len": 1 << (max(max_query_len, 1) - 1).bit_length(),
    }


def write_variant_configs(
    out_dir: Path,
    family: str,
    device_name: str,
    shape: Shape,
    prefill: tuple[dict[str, bool | int], list[int]],  # (winning params, max query lens it covers)
    decode_flags: dict[str, bool | int] | None,  # flags to add to the decode entries, or None
) -> list[Path]:
    """Write `unified_attention_{2d,3d}-<family>.json` into `out_dir`: the shipped file of that
    family (the default file where there is none) with the prefill class's entry replaced by the
    winner and, if `decode_flags`, the decode classes' entries given those flags. Only files that
    change are written. Returns their paths."""
    written = []
    for kernel in ("unified_attention_2d", "unified_attention_3d"):
        source = CONFIG_DIR / f"{kernel}-{family}.json"
        if not source.exists():
            source = CONFIG_DIR / f"{kernel}-default.json"
        content = json.loads(source.read_text())
        original = json.dumps(content, sort_keys=True)
        content["device"] = family
        if kernel == "unified_attention_2d":
            for max_query_len in prefill[1]:
                replace_entry_params(content, device_name, _shape_keys(shape, max_query_len), prefill[0])
        if decode_flags:
            keys = _shape_keys(shape, 1)
            current = TunedConfigs([(source, TunedConfigFile.model_validate(content))]).lookup(
                kernel, device_name, **keys
            )
            replace_entry_params(content, device_name, keys, {**current, **decode_flags})  # type: ignore[dict-item]
        if json.dumps(content, sort_keys=True) == original:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{kernel}-{family}.json"
        path.write_text(json.dumps(content, indent=2) + "\n")
        written.append(path)
    return written


@dataclass(frozen=True, slots=True)
class VariantRun:
    """What every step of the --variants mode shares."""

    shape: Shape
    device: torch.device
    device_name: str
    timer: Timer
    tolerance: float
    started: float  # time.perf_counter() at the start
    flops: dict[str, int]  # case name -> causal FLOPs
    kv_bytes: dict[str, int]  # case name -> needed K/V bytes

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.started:6.1f} s] {message}", file=sys.stderr, flush=True)

    def batches(self, cases: list[TableCase]) -> list[tuple[TableCase, Batch, torch.Tensor]]:
        """Each case's batch with the shipped configs' output (what every variant must match)."""
        shipped = BACKEND[0]()
        out = []
        for c in cases:
            batch = make_batch(self.shape, c.query_lens, c.seq_lens, device=self.device.type)
            ref = shipped.forward(
                batch.query, batch.kv_cache, batch.metadata, scale=self.shape.head_size**-0.5
            )
            out.append((c, batch, ref.clone()))
        return out

    def prefill_entry(self, params: dict[str, bool | int]) -> dict[str, list[dict[str, object]]]:
        """Overrides giving every query longer than 16 tokens the 2D kernel's `params`."""
        entry = {"match": {"head_size": self.shape.head_size, "max_query_len_ge": 17}, "params": params}
        return {"unified_attention_2d": [entry]}


def sweep_order(
    variants: list[str], points: tuple[tuple[int, int, int, int], ...]
) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(variant, point) pairs in the order the sweep times them: point by point, and the variants
    whose interior loop is a `tl.range` with attributes (LOOP_STAGES, WARP_SPECIALIZE: the least
    proven compiler paths; compiled for sm_90 by Triton 3.9 such a loop is not pipelined at all)
    after all the others, so a budget cut or a failure there costs the rest nothing. Pure."""
    late = [
        v for v in variants if LOOP_VARIANTS[v].get("WARP_SPECIALIZE") or LOOP_VARIANTS[v].get("LOOP_STAGES")
    ]
    early = [v for v in variants if v not in late]
    return [(v, p) for p in points for v in early] + [(v, p) for p in points for v in late]


def sweep_prefill(
    run: VariantRun,
    cases: list[TableCase],
    pairs: list[tuple[str, tuple[int, int, int, int]]],
    deadline_s: float,
) -> tuple[list[VariantResult], int]:
    """Each (variant, launch point) of `pairs` on the prefill `cases`, until `deadline_s` seconds
    after the start; returns the results, best first, and how many pairs the deadline skipped."""
    batches = run.batches(cases)
    flops = {c.name: run.flops[c.name] for c in cases}
    results: list[VariantResult] = []
    skipped = 0
    for name, point in pairs:
        if time.perf_counter() - run.started > deadline_s:
            skipped += 1
            continue
        run.log(f"{name} {point} ...")
        params = point_params(point, LOOP_VARIANTS[name])
        configs = configs_with(run.device_name, run.prefill_entry(params))
        res = run_variant_group(name, params, batches, configs, run.timer)
        results.append(res)
        run.log(f"{name} {point}: {res.error or f'{prefill_score(res, flops):.1f} TFLOP/s'}")
    del batches
    if run.device.type == "cuda":
        torch.cuda.empty_cache()
    return sorted(results, key=lambda r: -prefill_score(r, flops)), skipped


def check_decode(
    run: VariantRun, cases: list[TableCase], candidates: dict[str, dict[str, bool | int]]
) -> list[VariantResult]:
    """The decode `cases` (heuristic 2D/3D plan) with the shipped decode entries plus each
    candidate's flags; the first candidate should be the plain loop ({})."""
    batches = run.batches(cases)
    results = []
    for name, flags in candidates.items():
        overrides: dict[str, list[dict[str, object]]] = {}
        for kernel in ("unified_attention_2d", "unified_attention_3d"):
            params = {**shipped_params(kernel, run.device_name, run.shape, 1), **flags}
            match = {"head_size": run.shape.head_size, "max_query_len_le": 16}
            overrides[kernel] = [{"match": match, "params": params}]
        results.append(
            run_variant_group(name, flags, batches, configs_with(run.device_name, overrides), run.timer)
        )
        run.log(f"decode {name}: {results[-1].error or 'ok'}")
    return results


def check_mixed(run: VariantRun, cases: list[TableCase], winner: VariantResult | None) -> list[VariantResult]:
    """The mixed batches (their prefills use the prefill entry) with the shipped configs and with
    the prefill winner."""
    batches = run.batches(cases)
    shipped = shipped_params("unified_attention_2d", run.device_name, run.shape, max(cases[0].query_lens))
    results = [run_variant_group("shipped", shipped, batches, configs_with(run.device_name, {}), run.timer)]
    if winner is not None:
        configs = configs_with(run.device_name, run.prefill_entry(winner.params))
        results.append(run_variant_group("winner", winner.params, batches, configs, run.timer))
    return results


def print_variant_table(
    title: str,
    results: list[VariantResult],
    cases: list[TableCase],
    rate: Callable[[str, float], float],
    tolerance: float,
    *,
    by_case: bool,
) -> None:
    """One row per result (`by_case` False: the prefill sweep, columns = cases) or per case (`by_case`
    True: the decode check, columns = results); each cell is "us rate", "!" marks an output that
    differs from the shipped configs' by more than `tolerance`."""

    def cell(r: VariantResult, case: str) -> str:
        us = r.us.get(case)
        if us is None:
            return f"{'-':>10} {'':>7}"
        return f"{us:>9.1f}{'!' if r.max_diff > tolerance else ' '} {rate(case, us):>7.1f}"

    print(f"\n{title}")
    if by_case:
        print(f"{'case':<26}" + "".join(f"  {r.variant[:18]:>18}" for r in results))
        for c in cases:
            print(f"{c.name:<26}" + "".join(f"  {cell(r, c.name)}" for r in results))
        for r in results:
            if r.error is not None:
                print(f"  {r.variant}: failed: {r.error}")
        return
    print(
        f"{'variant':<15}{'BLOCK_M':>8}{'TILE':>5}{'warps':>6}{'stages':>7}"
        + "".join(f"  {c.name[:18]:>18}" for c in cases)
    )
    for r in results:
        p = r.params
        row = f"{r.variant:<15}{p['BLOCK_M']:>8}{p['TILE_SIZE']:>5}{p['num_warps']:>6}{p['num_stages']:>7}"
        print(row + (f"  failed: {r.error}" if r.error else "".join(f"  {cell(r, c.name)}" for c in cases)))


def decode_candidates(winner: VariantResult | None) -> dict[str, dict[str, bool | int]]:
    """The param sets the decode check lays over the shipped decode entries: none (the plain
    loop), prefetching at 3 stages (the entries run 2, where even prefetched K/V loads get no tile
    in flight during the dots), and the prefill winner's variant flags when they differ from
    both. Pure."""
    candidates: dict[str, dict[str, bool | int]] = {
        "plain": {},
        "prefetch+3stages": {"PREFETCH_BLOCK_IDS": True, "num_stages": 3},
    }
    if winner is not None:
        launch = ("BLOCK_M", "TILE_SIZE", "num_warps", "num_stages")
        flags = {k: v for k, v in winner.params.items() if k not in launch}
        if flags not in candidates.values():
            candidates[f"{winner.variant} (winner)"] = flags
    return candidates


def run_variants(args: argparse.Namespace) -> None:
    """The --variants mode: the prefill sweep (sorted by geometric-mean TFLOP/s), the decode and
    mixed check, the verdict; writes the winners' files with --write-configs."""
    smoke = bool(args.smoke)
    device = torch.device("cpu" if smoke else "cuda")
    dtype = DTYPES[args.dtype]
    shape = Shape(args.q_heads, args.kv_heads, 32 if smoke else args.head_size, args.block_size, dtype)
    cases = table_cases(SMOKE_SIZES if smoke else TableSizes())
    run = VariantRun(
        shape,
        device,
        device_name_of(device),
        Timer(device),
        {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-3}[dtype],
        time.perf_counter(),
        {c.name: causal_flops(c.query_lens, c.seq_lens, shape.q_heads, shape.head_size) for c in cases},
        {c.name: needed_kv_bytes(c.seq_lens, shape.kv_heads, shape.head_size, dtype.itemsize) for c in cases},
    )
    print(
        f"{_device_line(device)}: {shape.q_heads}q/{shape.kv_heads}kv heads, head {shape.head_size}, "
        f"{args.dtype}, block {shape.block_size}{' (SMOKE: timings meaningless)' if smoke else ''}",
        flush=True,
    )
    prefill_cases = [c for c in cases if c.kind in ("prefill", "chunked")]
    points = SMOKE_POINTS if smoke else PREFILL_POINTS
    # The decode and mixed check keeps the last 80 s of the budget (15 s in a smoke run).
    unknown = sorted(set(args.skip_variant) - set(LOOP_VARIANTS))
    if unknown:
        raise SystemExit(f"--skip-variant: unknown {unknown}; variants: {list(LOOP_VARIANTS)}")
    pairs = sweep_order([v for v in LOOP_VARIANTS if v not in args.skip_variant], points)
    ranked, skipped = sweep_prefill(run, prefill_cases, pairs, args.budget_s - (15 if smoke else 80))
    prefill_flops = {c.name: run.flops[c.name] for c in prefill_cases}
    winner = next(
        (r for r in ranked if prefill_score(r, prefill_flops) > 0 and r.max_diff <= run.tolerance), None
    )
    decode_cases = [c for c in cases if c.kind == "decode"]
    candidates = decode_candidates(winner)
    decode_results = check_decode(run, decode_cases, candidates)
    mixed_cases = [c for c in cases if c.kind == "mixed"]
    mixed_results = check_mixed(run, mixed_cases, winner)

    def tflops(case: str, us: float) -> float:
        return run.flops[case] / us / 1e6

    def tbps(case: str, us: float) -> float:
        return run.kv_bytes[case] / us / 1e6

    shipped = shipped_params("unified_attention_2d", run.device_name, shape, 2048)
    title = f"prefill sweep (2D kernel): us TFLOP/s per case, best first; shipped entry {shipped}"
    print_variant_table(title, ranked, prefill_cases, tflops, run.tolerance, by_case=False)
    if skipped:
        print(f"({skipped} variant x point combinations skipped: --budget-s {args.budget_s:g} spent)")
    title = "decode check (heuristic plan; decode entries + each variant's flags): us TB/s"
    print_variant_table(title, decode_results, decode_cases, tbps, run.tolerance, by_case=True)
    title = "mixed batch (its prefills use the prefill entry): shipped vs prefill winner, us TB/s"
    print_variant_table(title, mixed_results, mixed_cases, tbps, run.tolerance, by_case=True)
    adopted = choose_decode_flags(decode_results, candidates, run.tolerance)
    print(f"\ntotal {time.perf_counter() - run.started:.0f} s")
    first = next(
        (r for r in ranked if r.variant == "plain" and r.params == point_params(points[0], {})), None
    )
    if winner is None:
        print("no prefill result ran correctly: nothing to write")
    else:
        base = prefill_score(first, prefill_flops) if first is not None else float("nan")
        print(
            f"prefill winner: {winner.variant} {winner.params}: {prefill_score(winner, prefill_flops):.1f} "
            f"TFLOP/s geomean (first point, plain loop: {base:.1f})"
        )
        verdict = f"adopt the flags of {adopted[0]}: {adopted[1]}" if adopted else "keep the shipped entries"
        print(f"decode: {verdict}")
    if args.json is not None:
        payload = {
            "device": _device_line(device),
            "smoke": smoke,
            "prefill": [asdict(r) for r in ranked],
            "decode": [asdict(r) for r in decode_results],
            "mixed": [asdict(r) for r in mixed_results],
            "winner": None if winner is None else asdict(winner),
            "decode_adopted": None if adopted is None else adopted[1],
            "flops": prefill_flops,  # case name -> causal FLOPs, for TFLOP/s from "us"
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.write_configs is not None and winner is not None:
        family = "default" if smoke else device_family(run.device_name)
        prefill = (winner.params, sorted({max(c.query_lens) for c in prefill_cases}))
        decode_flags = adopted[1] if adopted else None
        for path in write_variant_configs(
            args.write_configs, family, run.device_name, shape, prefill, decode_flags
        ):
            print(f"wrote {path}")


def _device_line(device: torch.device) -> str:
    return torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--spec", type=int, default=0, help="also time speculative queries of this length")
    parser.add_argument("--prefill", action="store_true", help="also time prefills and a mixed batch")
    parser.add_argument("--splits-sweep", action="store_true", help="also time forced 3D split counts")
    parser.add_argument("--no-sdpa", dest="sdpa", action="store_false")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        default="auto",
        help="the grid's cache: auto (= --dtype) or FP8; GB/s then counts FP8 bytes",
    )
    parser.add_argument(
        "--flex", action="store_true", help="also time torch FlexAttention (compiles per shape)"
    )
    parser.add_argument("--tune", type=Path, metavar="OUT_DIR", help="sweep launch params; write JSON here")
    parser.add_argument(
        "--table", action="store_true", help="the standard case table, all baselines, one table"
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="time the 2D kernel's interior-loop variants x a launch grid on the prefill cases, then "
        "check decode; one table",
    )
    parser.add_argument(
        "--write-configs",
        type=Path,
        metavar="OUT_DIR",
        help="with --variants: write the winners' tuned-config files here (the plugin's configs "
        "directory to update them in place)",
    )
    parser.add_argument(
        "--skip-variant",
        action="append",
        default=[],
        metavar="NAME",
        help="with --variants: leave this variant out (repeatable; names in LOOP_VARIANTS)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=225.0,
        help="with --variants: seconds after which the prefill sweep skips its remaining points "
        "(the decode check keeps 80 s of it)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="with --table or --variants: tiny shapes on CPU (TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="with --table or --variants: write every number here"
    )
    parser.add_argument(
        "--flex-budget-s",
        type=float,
        default=150.0,
        help="with --table: seconds of Flex compile + timing after which Flex is skipped",
    )
    parser.add_argument(
        "--backend",
        choices=["triton", "rocm"],
        default="triton",
        help="rocm: the rocm platform's backend (AMD tables, XCD grid order; on an AMD GPU)",
    )
    args = parser.parse_args()
    if args.backend == "rocm":
        if args.tune is not None:
            raise SystemExit(
                "--tune writes the Triton plugin's files; sweep with the default --backend triton (on the AMD"
                " GPU too) and copy the winners into plugins/rocm/pagedserve_rocm/configs by hand"
            )
        from pagedserve_rocm.attention import RocmUnifiedAttentionBackend

        BACKEND[0] = RocmUnifiedAttentionBackend
    if args.write_configs is not None and not args.variants:
        raise SystemExit("--write-configs applies only with --variants")
    if args.variants:
        if args.backend != "triton":
            raise SystemExit("--variants times the Triton plugin's configs: use the default --backend triton")
        if args.smoke and not INTERPRETED:
            raise SystemExit("--smoke runs Triton on CPU: set TRITON_INTERPRET=1 in the environment")
        if not args.smoke and not torch.cuda.is_available():
            raise SystemExit("--variants needs a CUDA GPU; use --smoke for the CPU plumbing check")
        run_variants(args)
        return
    if args.table:
        if args.smoke and not INTERPRETED:
            raise SystemExit("--smoke runs Triton on CPU: set TRITON_INTERPRET=1 in the environment")
        if not args.smoke and not torch.cuda.is_available():
            raise SystemExit("--table needs a CUDA GPU; use --smoke for the CPU plumbing check")
        run_case_table(args)
        return
    if args.smoke or args.json is not None:
        raise SystemExit("--smoke and --json apply only with --table or --variants")
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/kernels/attention.py needs a CUDA/ROCm GPU (torch.cuda.is_available() is False)"
        )
    shape = Shape(args.q_heads, args.kv_heads, args.head_size, args.block_size, DTYPES[args.dtype])
    print(f"{torch.cuda.get_device_name()}: {shape}")
    if args.tune is not None:
        tune(shape, args.tune)
        return
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    cases = [(f"decode b{b} ctx{c}", [1] * b, [c] * b) for b in batches for c in contexts]
    if args.spec:
        cases += [
            (f"spec{args.spec} b{b} ctx{c}", [args.spec] * b, [c] * b) for b in batches for c in contexts
        ]
    if args.prefill:
        cases += [(f"prefill b1 len{c}", [c], [c]) for c in contexts]
        cases += [("prefill b4 len2048", [2048] * 4, [2048] * 4)]
    run_grid(shape, cases, args)
    if args.prefill:
        print("mixed batch (SDPA n/a: ragged):")
        mixed = make_batch(shape, [512] + [1] * 63, [1536] + [2048] * 63)
        print(f"  chunk 512 + 63 decodes ctx 2048: {triton_time(mixed, None):.1f} us ({plan_of(mixed)})")


if __name__ == "__main__":
    main()
