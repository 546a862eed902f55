"""`attention.py --table`: the standard case table (`attention_cases`), every backend in one run,
one table: ours as the engine calls it and forced onto the 2D kernel, SDPA flash and cuDNN, and
FlexAttention, with vLLM's reference times and the goals beside them; `--json` keeps every number.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
from attention_baselines import Measured, Timer, flex_builder, make_groups, measure, sdpa_builder
from attention_batches import (
    BACKEND,
    DTYPES,
    TOLERANCES,
    Batch,
    Shape,
    device_line,
    make_batch,
    new_kv_of,
    ours_call,
    plan_of,
)
from attention_cases import (
    REFERENCE_NOTES,
    SMOKE_SIZES,
    VLLM_REFERENCE_US,
    TableCase,
    TableSizes,
    Target,
    case_target,
    causal_flops,
    needed_kv_bytes,
    table_cases,
    target_met,
)

from pagedserve_triton.ragged_prefill import unsupported_reason as ragged_unsupported_reason


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
    tolerance = TOLERANCES[dtype]
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
            f"\n{device_line(device)}; dtype {args.dtype}, block {args.block_size}, shuffled block tables; "
            f"total {time.perf_counter() - started:.0f} s{' (SMOKE: timings meaningless)' if smoke else ''}"
        )
        print_case_table(results, tolerance)
        if args.json is not None:
            payload = {
                "device": device_line(device),
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
