"""Time the Triton unified attention backend on a GPU, against torch SDPA (and FlexAttention with
--flex), and optionally sweep launch parameters to write tuned-config files.

Every timing replays a CUDA graph of one layer's attention call (no launch overhead, as the engine
runs decode steps), so it measures the kernels. Block tables are shuffled. Columns: the plan the
heuristic chose, its time, the forced-2D time and, with --splits-sweep, every forced split count,
plus effective K/V bandwidth. SDPA and Flex read a contiguous (unpaged) copy of the same K/V, an
upper bound that a paged kernel cannot beat by layout alone.

    PYTHONPATH=core:plugins/triton python benchmarks/attention.py                  # decode grid
    PYTHONPATH=core:plugins/triton python benchmarks/attention.py --prefill --splits-sweep
    PYTHONPATH=core:plugins/triton python benchmarks/attention.py --tune OUT_DIR   # writes JSON

Defaults are a Llama-3-8B layer: 32 query heads, 8 KV heads, head size 128, bfloat16, block 16.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms.tuned_configs import TunedConfigFile, TunedConfigs, device_family
from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.launch_params import CONFIG_DIR

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


def make_batch(shape: Shape, query_lens: list[int], seq_lens: list[int]) -> Batch:
    """Random data in a cache whose blocks are handed out in shuffled order. Does not mutate."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    need = [-(-s // shape.block_size) for s in seq_lens]
    num_blocks = sum(need)
    kv = torch.randn(
        2,
        num_blocks,
        shape.block_size,
        shape.kv_heads,
        shape.head_size,
        device="cuda",
        dtype=shape.dtype,
        generator=gen,
    )
    ids = torch.randperm(num_blocks, device="cuda", generator=gen).int()
    table = torch.zeros(len(need), max(need), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[used : used + n]
        used += n
    md = AttentionMetadata.build(query_lens, seq_lens, table, shape.block_size, device="cuda")
    q = torch.randn(
        md.num_actual_tokens, shape.q_heads, shape.head_size, device="cuda", dtype=shape.dtype, generator=gen
    )
    return Batch(q, kv, md, query_lens, seq_lens)


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
    backend = TritonUnifiedAttentionBackend(num_splits=num_splits, tuned_configs=configs)
    out = torch.empty_like(batch.query)
    scale = batch.query.shape[-1] ** -0.5
    return time_graph(
        lambda: backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out)
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
    plan = TritonUnifiedAttentionBackend().plan(
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
    for name, qlens, slens in cases:
        batch = make_batch(shape, qlens, slens)
        heur = triton_time(batch, None)
        row = f"{name:<28}{plan_of(batch):>7}{heur:>9.1f}{triton_time(batch, 1):>9.1f}"
        can_split = max(qlens) <= 16
        row += "".join(f"{triton_time(batch, s) if can_split else float('nan'):>8.1f}" for s in sweep)
        row += f"{kv_bytes(batch) / heur / 1e3:>8.0f}"
        row += f"{sdpa_time(batch):>9.1f}" if args.sdpa else f"{'-':>9}"
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
            content = _config_file(kernel, "default", [{"params": params}])
            files = [(Path(f"<sweep {kernel}>"), TunedConfigFile.model_validate(content))]
            # The other kernels keep their shipped configs; the swept kernel gets only this point.
            others = [p for p in sorted(CONFIG_DIR.glob("*.json")) if not p.name.startswith(kernel + "-")]
            files += [(p, TunedConfigFile.model_validate_json(p.read_text())) for p in others]
            try:
                t = triton_time(batch, 1 if kernel.endswith("2d") else None, TunedConfigs(files))
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
        "--flex", action="store_true", help="also time torch FlexAttention (compiles per shape)"
    )
    parser.add_argument("--tune", type=Path, metavar="OUT_DIR", help="sweep launch params; write JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA/ROCm GPU (torch.cuda.is_available() is False)")
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
