"""`attention.py` without `--table` or `--variants`: the grid of decode (and, with `--prefill`,
prefill) cases, each timed with the heuristic's plan, forced 2D and optionally every forced split
count, beside torch SDPA and FlexAttention on contiguous copies; and `--tune`, the launch-parameter
sweep that writes tuned-config files.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from attention_batches import (
    KV_CACHE_DTYPES,
    Batch,
    Shape,
    contiguous_kv,
    kv_bytes,
    make_batch,
    plan_of,
    triton_time,
)
from attention_configs import config_file_content, configs_with_point
from timing import time_graph

from pagedserve.platforms.tuned_configs import device_family
from pagedserve_triton.launch_params import CONFIG_DIR


def sdpa_time(batch: Batch) -> float:
    """Microseconds of torch SDPA on a contiguous copy of a uniform batch (CUDA-graph replays)."""
    k, v = contiguous_kv(batch)
    b, ql = len(batch.query_lens), batch.query_lens[0]
    q = batch.query.reshape(b, ql, -1, batch.query.shape[-1]).transpose(1, 2).contiguous()
    causal = ql > 1 and ql == batch.seq_lens[0]
    return time_graph(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))


def flex_time(batch: Batch) -> float:
    """Microseconds of compiled FlexAttention on a contiguous copy of a uniform batch."""
    from torch.nn.attention.flex_attention import flex_attention

    k, v = contiguous_kv(batch)
    b, ql = len(batch.query_lens), batch.query_lens[0]
    q = batch.query.reshape(b, ql, -1, batch.query.shape[-1]).transpose(1, 2).contiguous()
    compiled = torch.compile(flex_attention, dynamic=False)
    return time_graph(lambda: compiled(q, k, v, enable_gqa=True))


def grid_cases(args: argparse.Namespace) -> list[tuple[str, list[int], list[int]]]:
    """(name, query lens, seq lens) of every case the flags ask for. Pure."""
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
    return cases


def run_grid_mode(shape: Shape, args: argparse.Namespace) -> None:
    """The grid's table, then (with `--prefill`) one mixed batch, which SDPA cannot run."""
    run_grid(shape, grid_cases(args), args)
    if args.prefill:
        print("mixed batch (SDPA n/a: ragged):")
        mixed = make_batch(shape, [512] + [1] * 63, [1536] + [2048] * 63)
        print(f"  chunk 512 + 63 decodes ctx 2048: {triton_time(mixed, None):.1f} us ({plan_of(mixed)})")


def run_grid(shape: Shape, cases: list[tuple[str, list[int], list[int]]], args: argparse.Namespace) -> None:
    """One row per case: the plan, its time, forced 2D, forced splits, GB/s, SDPA and Flex."""
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
        path.write_text(json.dumps(config_file_content(kernel, family, entries + default), indent=2) + "\n")
        print(f"wrote {path}")
