"""On a GPU: the triton fused MoE op (`pagedserve_triton.moe_kernel`) against `torch._grouped_mm`.

For each model's expert shapes (below) and token count (1, 2, 4, ..., 4096 by default), bfloat16,
times one MoE layer's experts, from the router logits to the combined output, two ways:

  * `triton` — `MOE_KERNEL.op` as the engine calls it (shipped launch configs);
  * `grouped_mm` — torch: softmax top-k routing, a sort of the (token, slot) pairs by expert, the
    gathered rows through `torch._grouped_mm` with `w13` (gate/up), SiLU-and-multiply (gpt-oss:
    its clamped SwiGLU) and `torch._grouped_mm` with `w2`, and the weighted sum per token. No
    host sync either, so both are captured the same way.

Times are CUDA-graph replays: one graph of `--calls` calls, each with its own random router
logits and activations (so decode steps route to fresh experts, which are then read from memory
rather than from L2), replayed `--replays` times; the median replay, per call.

Up to `--bound-tokens` tokens it also reports the memory bound: the bytes of the distinct experts
each call routes to (averaged over the calls), read at the device's copy bandwidth (a large
device-to-device copy timed in the same run, counting bytes read plus bytes written), and the
triton op's time over it (`vs_bound`; the target is 1.25 or less).

    python benchmarks/kernel_benchmarks/moe_op.py --json moe.json
    python benchmarks/kernel_benchmarks/moe_op.py --models qwen3_30b_a3b --tokens 1,64,4096 --check
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ExpertShape:
    """One model's MoE layer: E experts of hidden size H and intermediate size I, top-k routing."""

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    scoring: str  # `MoERouting.scoring`
    renormalize: bool
    activation: str  # `MoEActivation`
    swiglu_limit: float | None = None
    bias: bool = False  # gpt-oss's experts carry biases

    def expert_bytes(self, weight_bytes: int = 2) -> int:
        """Bytes of one expert's w13 and w2 (and biases) at `weight_bytes` bytes per weight."""
        weights = 3 * self.hidden * self.intermediate * weight_bytes
        return weights + ((2 * self.intermediate + self.hidden) * 2 if self.bias else 0)


MODELS = {
    shape.name: shape
    for shape in (
        ExpertShape("qwen3_30b_a3b", 128, 8, 2048, 768, "softmax_topk", True, "silu"),
        ExpertShape("gpt_oss_20b", 32, 4, 2880, 2880, "topk_softmax", False, "swiglu_limit", 7.0, True),
        ExpertShape("mixtral_8x7b", 8, 2, 4096, 14336, "softmax_topk", True, "silu"),
    )
}
DEFAULT_TOKENS = tuple(1 << i for i in range(13))  # 1 .. 4096


@dataclass(frozen=True, slots=True)
class Point:
    """One (model, tokens) measurement; times in microseconds per call."""

    model: str
    tokens: int
    triton_us: float | None
    grouped_mm_us: float | None
    distinct_experts: float  # mean over the calls
    bound_us: float | None  # bytes of the distinct experts / copy bandwidth (small steps only)
    max_rel_error: float | None = None  # --check: against the float32 torch formulation
    replay_ok: bool | None = None  # --check: a graph replayed on new routing gives the eager bits
    error: str | None = None

    @property
    def speedup(self) -> float | None:
        """grouped_mm time over triton time (> 1: triton is faster)."""
        if self.triton_us is None or self.grouped_mm_us is None:
            return None
        return self.grouped_mm_us / self.triton_us

    @property
    def vs_bound(self) -> float | None:
        """triton time over the memory bound (1.0: at the bound)."""
        if self.triton_us is None or self.bound_us is None:
            return None
        return self.triton_us / self.bound_us


def parse_tokens(text: str) -> tuple[int, ...]:
    """ "1,2,64" -> (1, 2, 64). Raises `argparse.ArgumentTypeError` for anything but positive
    integers. Pure."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"token counts must be integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return values


def parse_models(text: str) -> tuple[str, ...]:
    """ "a,b" -> ("a", "b"), each a key of MODELS. Raises `argparse.ArgumentTypeError`. Pure."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"unknown models {unknown or text!r}; known: {', '.join(MODELS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", type=parse_models, default=tuple(MODELS), help="comma-separated")
    parser.add_argument("--tokens", type=parse_tokens, default=DEFAULT_TOKENS, help="comma-separated counts")
    parser.add_argument("--bound-tokens", type=int, default=64, help="report the memory bound up to this")
    parser.add_argument("--calls", type=int, default=8, help="calls (fresh routings) per CUDA graph")
    parser.add_argument("--replays", type=int, default=20, help="timed replays of each graph")
    parser.add_argument("--check", action="store_true", help="also compare outputs with torch")
    parser.add_argument("--no-baseline", action="store_true", help="skip torch._grouped_mm")
    parser.add_argument("--json", type=Path, default=None, help="write the points here")
    return parser


def distinct_experts(ids: torch.Tensor) -> int:
    """How many different experts one call's `ids` [M, k] route to. Pure."""
    return int(torch.unique(ids).numel())


def bound_us(distinct: float, expert_bytes: int, copy_bytes_per_s: float) -> float:
    """Microseconds to read `distinct` experts of `expert_bytes` each at the copy bandwidth. Pure."""
    return distinct * expert_bytes / copy_bytes_per_s * 1e6


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(points: Sequence[Point], copy_bytes_per_s: float | None) -> str:
    """The points as a markdown table, one row each, in the given order. Pure."""
    lines = []
    if copy_bytes_per_s is not None:
        lines += [f"copy bandwidth: {copy_bytes_per_s / 1e12:.2f} TB/s (read + written)", ""]
    lines += [
        "| model | tokens | triton us | grouped_mm us | speedup | experts | bound us | vs bound | rel err"
        " | replay |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in points:
        cells = [
            p.model,
            str(p.tokens),
            _fmt(p.triton_us, ".1f"),
            _fmt(p.grouped_mm_us, ".1f"),
            _fmt(p.speedup, ".2f"),
            f"{p.distinct_experts:.1f}",
            _fmt(p.bound_us, ".1f"),
            _fmt(p.vs_bound, ".2f"),
            _fmt(p.max_rel_error, ".1e") if p.error is None else f"error: {p.error}",
            "-" if p.replay_ok is None else ("yes" if p.replay_ok else "NO"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(points: Sequence[Point], copy_bytes_per_s: float | None, device: str) -> dict[str, Any]:
    """The JSON document of a run. Pure."""
    return {
        "device": device,
        "copy_bytes_per_s": copy_bytes_per_s,
        "points": [{**asdict(p), "speedup": p.speedup, "vs_bound": p.vs_bound} for p in points],
    }


# --- GPU only below ---------------------------------------------------------------------------


def graph_us_per_call(calls: Sequence[Callable[[], object]], replays: int) -> float:
    """Median us per call of one CUDA graph holding every call of `calls`, replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # compile and warm up outside the graph
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes per second (read plus written) of a device-to-device copy of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = graph_us_per_call([lambda: dst.copy_(src)] * 4, replays=10)
    return 2 * nbytes / (us * 1e-6)


def _replays_bitwise(
    op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    xs: Sequence[torch.Tensor],
    logits: Sequence[torch.Tensor],
) -> bool:
    """Whether `op` captured on one routing and replayed on others gives the bits of eager calls
    (which must also repeat their own bits)."""
    static_x, static_logits = xs[0].clone(), logits[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        op(static_x, static_logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = op(static_x, static_logits)
    ok = True
    for x, lg in zip(xs[1:], logits[1:], strict=True):
        static_x.copy_(x)
        static_logits.copy_(lg)
        graph.replay()
        eager = op(x, lg)
        ok = ok and torch.equal(out, eager) and torch.equal(eager, op(x, lg))
    return ok


def grouped_mm_moe(
    x: torch.Tensor, logits: torch.Tensor, w13_t: torch.Tensor, w2_t: torch.Tensor, shape: ExpertShape,
    b13: torch.Tensor | None, b2: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """The torch baseline (module docstring); `w13_t` [E, H, 2I] and `w2_t` [E, I, H] views."""
    m, k, e = x.shape[0], shape.top_k, shape.num_experts
    if shape.scoring == "softmax_topk":
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        if shape.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        top, ids = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
    tokens = order // k
    h = torch._grouped_mm(x[tokens], w13_t, offs=offs)
    if b13 is not None:
        h = h + b13[flat[order]]
    gate, up = h.float().chunk(2, dim=-1)
    if shape.activation == "silu":
        act = torch.nn.functional.silu(gate) * up
    else:
        limit = shape.swiglu_limit or 0.0
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    y = torch._grouped_mm(act.to(x.dtype), w2_t, offs=offs)
    if b2 is not None:
        y = y + b2[flat[order]]
    per_pair = torch.empty_like(y)
    per_pair[order] = y
    return (per_pair.view(m, k, -1).float() * weights[..., None]).sum(dim=1).to(x.dtype)


def measure(
    shape: ExpertShape, token_counts: Sequence[int], args: argparse.Namespace, bandwidth: float
) -> list[Point]:
    from pagedserve.moe.reference import moe_forward_reference
    from pagedserve.moe.routing import select_experts
    from pagedserve.platforms.api import ExpertWeights, MoERouting
    from pagedserve_triton.moe_kernel import MOE_KERNEL

    dtype, dev = torch.bfloat16, "cuda"
    e, h, i = shape.num_experts, shape.hidden, shape.intermediate
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=gen) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device=dev, generator=gen) / i**0.5).to(dtype)
    b13 = torch.randn(e, 2 * i, device=dev, generator=gen).to(dtype) * 0.1 if shape.bias else None
    b2 = torch.randn(e, h, device=dev, generator=gen).to(dtype) * 0.1 if shape.bias else None
    experts = ExpertWeights(w13, w2, w13_bias=b13, w2_bias=b2)
    routing = MoERouting(shape.top_k, shape.scoring, shape.renormalize, shape.activation, shape.swiglu_limit)  # type: ignore[arg-type]
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)
    points = []
    for m in token_counts:
        xs = [torch.randn(m, h, device=dev, generator=gen).to(dtype) for _ in range(args.calls)]
        logits = [torch.randn(m, e, device=dev, generator=gen) for _ in range(args.calls)]
        distinct = statistics.mean(distinct_experts(select_experts(lg, routing)[1]) for lg in logits)
        bound = bound_us(distinct, shape.expert_bytes(), bandwidth) if m <= args.bound_tokens else None
        ours = theirs = rel = replay_ok = None
        error = None
        inputs = list(zip(xs, logits, strict=True))
        try:
            ours = graph_us_per_call(
                [functools.partial(MOE_KERNEL.op, x, lg, experts, routing) for x, lg in inputs], args.replays
            )
            if args.check:
                want = moe_forward_reference(xs[0].float(), logits[0], ExpertWeights(
                    w13.float(), w2.float(), w13_bias=None if b13 is None else b13.float(),
                    w2_bias=None if b2 is None else b2.float()), routing)  # fmt: skip
                got = MOE_KERNEL.op(xs[0], logits[0], experts, routing).float()
                rel = float((got - want).norm() / want.norm())
                replay_ok = _replays_bitwise(lambda x, lg: MOE_KERNEL.op(x, lg, experts, routing), xs, logits)
            if not args.no_baseline:
                theirs = graph_us_per_call(
                    [
                        functools.partial(grouped_mm_moe, x, lg, w13_t, w2_t, shape, b13, b2)
                        for x, lg in inputs
                    ],
                    args.replays,
                )
        except Exception as exc:  # one bad point must not lose the others
            error = f"{type(exc).__name__}: {str(exc)[:200]}"
        point = Point(shape.name, m, ours, theirs, distinct, bound, rel, replay_ok, error)
        print(markdown_table([point], None).splitlines()[-1], flush=True)
        points.append(point)
    return points


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_op.py needs a GPU (torch sees none)", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    points = []
    for name in args.models:
        points += measure(MODELS[name], args.tokens, args, bandwidth)
    device = torch.cuda.get_device_name()
    print(f"\n{device}\n")
    print(markdown_table(points, bandwidth))
    if args.json is not None:
        args.json.write_text(json.dumps(report(points, bandwidth, device), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
