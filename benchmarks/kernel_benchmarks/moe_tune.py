"""On a GPU: search launch configs of the triton fused MoE op for one model's expert shapes, and
write the winners as tuned-config entries (`plugins/triton/pagedserve_triton/configs/
fused_moe-<device>.json`, schema `pagedserve.platforms.tuned_configs`).

For each token count, a coordinate search, timed as `moe_op.py` times the op (CUDA-graph replays
of `--calls` calls on fresh routings, median per call):

1. `BLOCK_M` (pairs per block) x the gate/up tiles, with the shipped down tiles;
2. the down tiles, with the best of step 1;
3. on the best, `WEIGHT_MAJOR` flipped (Hopper's warpgroup MMA takes 16- and 32-row blocks only
   with the weight tile as the dot's M side).

The shipped config is timed too and kept unless a candidate beats it by `--min-gain` (2%), so
noise never replaces a measured entry. Each token count's winner becomes one entry matching the
model's shape keys and its `tokens_per_expert` bucket (`moe_kernel.moe_config`); token counts that
share a bucket keep the entry of the first one listed.

    python benchmarks/kernel_benchmarks/moe_tune.py --model qwen3_30b_a3b --tokens 64,256,1024,4096 \\
        --json moe_tune_qwen3.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_op import MODELS, ExpertShape, graph_us_per_call, parse_tokens

BLOCK_MS = (16, 32, 64, 128)
GATE_UP_TILES = ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3))
DOWN_TILES = ((64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3), (128, 64, 8, 3), (64, 256, 4, 3))


def candidate_block_ms(tokens_per_expert: int) -> tuple[int, ...]:
    """Block heights worth trying for this many pairs per expert: from 16 up to the first at least
    twice the average (taller blocks only pad). Pure."""
    out = []
    for block_m in BLOCK_MS:
        out.append(block_m)
        if block_m >= 2 * tokens_per_expert:
            break
    return tuple(out)


def params_of(config: Any) -> dict[str, int | bool]:
    """A `MoEConfig` as the tuned-config file's params. Pure."""
    out: dict[str, int | bool] = {"BLOCK_M": config.block_m}
    for name, tiles in (("GATE_UP", config.gate_up), ("DOWN", config.down)):
        out[f"{name}_BLOCK_N"] = tiles.block_n
        out[f"{name}_BLOCK_K"] = tiles.block_k
        out[f"{name}_WARPS"] = tiles.num_warps
        out[f"{name}_STAGES"] = tiles.num_stages
    if config.down_split_k:
        out["DOWN_SPLIT_K"] = config.down_split_k
    if config.weight_major:
        out["WEIGHT_MAJOR"] = True
    return out


def tune(shape: ExpertShape, m: int, args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve.platforms.api import ExpertWeights, MoERouting
    from pagedserve_triton.launch_params import device_name_of
    from pagedserve_triton.moe_kernel import GemmTiles, MoEConfig, fused_moe_forward, moe_config

    dtype, dev = torch.bfloat16, "cuda"
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    gen = torch.Generator(device=dev).manual_seed(m)
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=dev, generator=gen) / i**0.5).to(dtype)
    b13 = torch.randn(e, 2 * i, device=dev, generator=gen).to(dtype) * 0.1 if shape.bias else None
    b2 = torch.randn(e, h, device=dev, generator=gen).to(dtype) * 0.1 if shape.bias else None
    experts = ExpertWeights(w13, w2, w13_bias=b13, w2_bias=b2)
    routing = MoERouting(shape.top_k, shape.scoring, shape.renormalize, shape.activation, shape.swiglu_limit)  # type: ignore[arg-type]
    inputs = [
        (torch.randn(m, h, device=dev, generator=gen).to(dtype), torch.randn(m, e, device=dev, generator=gen))
        for _ in range(args.calls)
    ]
    shipped = moe_config(
        device_name_of(torch.device(dev)), num_experts=e, hidden_size=h, intermediate_size=i,
        top_k=shape.top_k, dtype=dtype, weight_dtype=dtype, tokens=m,
    )  # fmt: skip
    timed: dict[MoEConfig, float | None] = {}

    def time_of(config: MoEConfig) -> float | None:
        if config not in timed:
            op = functools.partial(fused_moe_forward, experts=experts, routing=routing, config=config)
            calls = [functools.partial(op, x, lg) for x, lg in inputs]
            try:
                timed[config] = graph_us_per_call(calls, args.replays)
            except Exception as exc:  # a config that fails to compile or launch loses only itself
                print(f"  {params_of(config)}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                timed[config] = None
        return timed[config]

    def best(configs: Sequence[MoEConfig]) -> MoEConfig:
        scored = [(t, c) for c in configs if (t := time_of(c)) is not None]
        return min(scored, key=lambda tc: tc[0])[1] if scored else shipped

    base_us = time_of(shipped)
    tokens_per_expert = -(-m * shape.top_k // e)
    step1 = [
        dataclasses.replace(shipped, block_m=bm, gate_up=GemmTiles(*gu), weight_major=False)
        for bm in candidate_block_ms(tokens_per_expert)
        for gu in GATE_UP_TILES
    ]
    winner = best([shipped, *step1])
    winner = best([winner, *(dataclasses.replace(winner, down=GemmTiles(*dn)) for dn in DOWN_TILES)])
    if winner.block_m <= 32:
        winner = best([winner, dataclasses.replace(winner, weight_major=not winner.weight_major)])
    win_us = time_of(winner)
    if base_us is not None and win_us is not None and win_us > base_us * (1 - args.min_gain):
        winner, win_us = shipped, base_us
    result = {
        "model": shape.name,
        "tokens": m,
        "tokens_per_expert": tokens_per_expert,
        "shipped_us": base_us,
        "best_us": win_us,
        "best": params_of(winner),
        "configs_timed": len(timed),
    }
    print(json.dumps(result), flush=True)
    return result


def entries(shape: ExpertShape, results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tuned-config entries (most specific first) for `results` of one shape: one per
    `tokens_per_expert` bucket (a power of two), the first result of each bucket. Pure."""
    out, seen = [], set()
    for r in sorted(results, key=lambda r: r["tokens"]):
        bucket = 1 << (max(r["tokens_per_expert"], 1) - 1).bit_length()
        if bucket in seen:
            continue
        seen.add(bucket)
        match = {
            "num_experts": shape.num_experts,
            "hidden_size": shape.hidden,
            "intermediate_size": shape.intermediate,
            "top_k": shape.top_k,
            "weight_dtype": "bfloat16",
            "tokens_per_expert_le": bucket,
        }
        out.append({"match": match, "params": r["best"]})
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3_30b_a3b")
    parser.add_argument("--tokens", type=parse_tokens, default=(64, 256, 1024, 4096), help="comma-separated")
    parser.add_argument("--calls", type=int, default=4, help="calls (fresh routings) per CUDA graph")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument(
        "--min-gain", type=float, default=0.02, help="keep the shipped config unless beaten by this"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the results and entries here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_tune.py needs a GPU (torch sees none)", file=sys.stderr)
        return 2
    shape = MODELS[args.model]
    results = [tune(shape, m, args) for m in args.tokens]
    report = {"device": torch.cuda.get_device_name(), "results": results, "entries": entries(shape, results)}
    print(json.dumps(report["entries"], indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
