"""`attention.py --variants`: the interior-loop variants of the 2D kernel x a focused launch grid,
timed on the table's two prefill cases; then a decode (and mixed-batch) no-regression check;
optionally the winners written into tuned-config files (`attention_configs`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from attention_baselines import Measured, Timer
from attention_batches import BACKEND, DTYPES, TOLERANCES, Batch, Shape, device_line, make_batch, ours_call
from attention_cases import SMOKE_SIZES, TableCase, TableSizes, causal_flops, needed_kv_bytes, table_cases
from attention_configs import configs_with, shipped_params, write_variant_configs

from pagedserve.platforms.tuned_configs import TunedConfigs, device_family
from pagedserve_triton.launch_params import device_name_of

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
        TOLERANCES[dtype],
        time.perf_counter(),
        {c.name: causal_flops(c.query_lens, c.seq_lens, shape.q_heads, shape.head_size) for c in cases},
        {c.name: needed_kv_bytes(c.seq_lens, shape.kv_heads, shape.head_size, dtype.itemsize) for c in cases},
    )
    print(
        f"{device_line(device)}: {shape.q_heads}q/{shape.kv_heads}kv heads, head {shape.head_size}, "
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
            "device": device_line(device),
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
