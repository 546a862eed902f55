"""Running one `MoECase` on a platform's `MoEKernel` and comparing with the float64 reference.

Inputs (drawn from the case's seed):

* x standard normal; w13 scaled so that every gate/up value is about standard normal (for the
  clamped SwiGLU, about as large as the limit, so that a good share of them is clamped); w2
  scaled so that the output is of order 1: the tolerance's absolute term then means what it says,
  and an expert's output is as large as the whole row's, so one wrong expert, weight or token is
  far outside any tolerance.
* Router logits (`RouterPattern`) that keep distinct values at least `LOGIT_GAP / 2` apart: the
  contract ranks experts by float32 scores, the oracle by float64 ones, and the two must not
  disagree on a near tie. The `TIES` rows hold exactly equal float32 logits instead, straddling
  the top-k boundary, so the kernel must pick the lower expert index as the contract says.
  float32, or, for a kernel with `logits_in_model_dtype`, in x's dtype, as the engine passes them.
* FP8 experts: each output channel quantized to `float8_e4m3fn` with its own float32 scale
  (absmax / 448, never a power of two), which the oracle dequantizes exactly.
* Junk rows (`MoECase.junk_rows`): rows of x and router_logits past the step's tokens holding
  NaN, +-inf and the dtype's largest values, as a CUDA graph's padding may.

Checks, in this order of reporting: the call must not raise; it must return a tensor of x's shape,
dtype and device (the engine adds it to the residual stream); it must leave every input unchanged
(bitwise); the step's rows must be finite and within the MoE tolerance of the oracle
(`MOE_TOLERANCES`), which runs `MoEKernel.op`'s torch formulation on the same (rounded) inputs in
float64 on the CPU. With junk rows: the call without them must pass the same checks, and a second call
whose junk rows of x hold other values (same router logits, so the same routing) must return the
step's rows bit for bit (the values of rows past the step may change nothing; bits, not a tolerance,
since they are exactly the same computation otherwise).

A failure beyond tolerance names its worst element (token, hidden channel, the token's experts and
weights), the experts every failing row shares, and the alternative formulation that reproduces the
output, if one does (ties to the higher index, the other renormalization or scoring, FP8 scales
ignored, biases or the SwiGLU clamp left out, one expert fewer per token).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pagedserve.conformance.cases import MoECase, RouterPattern, dtype_name
from pagedserve.conformance.guards import count_changed
from pagedserve.conformance.judging import judge_runs, junk_rows_problems
from pagedserve.conformance.results import CaseResult, ErrorStats, Status
from pagedserve.conformance.tolerances import Tolerance, moe_tolerance_for
from pagedserve.moe.reference import activate
from pagedserve.moe.routing import select_experts
from pagedserve.platforms.api import ExpertWeights, MoEKernel, MoERouting

COMPONENT = "moe"
LOGIT_GAP = 0.4  # spacing of distinct router logits: far above any float32 rounding of the scores
OUTPUT_RMS = 1.2  # each expert's output rms; a token's weighted sum of them is of order 1
FP8_MAX = 448.0  # the largest float8_e4m3fn value: absmax scaling uses the whole range
EXPLAINED = 0.2  # an alternative explains the output when it leaves at most this share of the error
IDLE_LOGIT = -30.0  # far below every ladder: an expert with it is never among a row's top k


@dataclass(frozen=True, slots=True)
class MoEInputs:
    """A case's inputs on the CPU, as the kernel receives them (junk rows included)."""

    x: torch.Tensor  # [M + junk, H], the case's dtype
    router_logits: torch.Tensor  # [M + junk, E] float32 (x's dtype for `logits_in_model_dtype`)
    experts: ExpertWeights  # the case's weight dtype (FP8 with float32 scales), biases in its dtype
    other_junk_x: torch.Tensor | None  # x with other values in its junk rows; None without junk rows


def _ladder(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, experts] float64: each row a shuffled ladder of values LOGIT_GAP apart, jittered by at
    most a quarter gap (so no two are closer than half a gap), centred on 0. Pure (given `gen`)."""
    ranks = torch.argsort(torch.rand(rows, experts, generator=gen), dim=-1).double()
    jitter = (torch.rand(rows, experts, generator=gen, dtype=torch.float64) - 0.5) * (LOGIT_GAP / 2)
    return (ranks - (experts - 1) / 2) * LOGIT_GAP + jitter


def _tie_row(experts: int, top_k: int, kind: int, gen: torch.Generator) -> torch.Tensor:
    """One row of tied logits, [experts] float64. `kind` cycles through: ties straddling the
    top-k boundary below some distinct winners; the whole row tied; exactly `top_k` tied at the top
    (no straddle: a control). The tied experts sit at random positions. Pure (given `gen`)."""
    if kind % 3 == 1:
        return torch.full((experts,), 0.25, dtype=torch.float64)
    if kind % 3 == 2:
        above, tied = 0, top_k
    else:
        above = int(torch.randint(top_k, (1,), generator=gen))  # 0 .. top_k - 1 distinct winners
        tied = min(experts - above, top_k - above + 1 + int(torch.randint(3, (1,), generator=gen)))
    below = experts - above - tied
    values = torch.cat(
        (
            torch.arange(above, 0, -1, dtype=torch.float64) * LOGIT_GAP,  # distinct, above the tie
            torch.zeros(tied, dtype=torch.float64),
            -torch.arange(1, below + 1, dtype=torch.float64) * LOGIT_GAP,
        )
    )
    return values[torch.argsort(torch.randperm(experts, generator=gen))]


def router_logits(case: MoECase, gen: torch.Generator) -> torch.Tensor:
    """The step's [M, E] float32 router logits for `case.pattern`. Pure (given `gen`)."""
    m, e = case.num_tokens, case.num_experts
    logits = _ladder(m, e, gen)
    if case.pattern is RouterPattern.IDLE:
        # Half the experts never chosen, always including the first and the last: index
        # arithmetic at either end of the expert range is where padding bugs live.
        idle = torch.randperm(e - 2, generator=gen)[: e // 2 - 2] + 1
        logits[:, torch.cat((torch.tensor([0, e - 1]), idle))] = IDLE_LOGIT
    elif case.pattern is RouterPattern.ONE_EXPERT:
        hot = 1 + int(torch.randint(e - 1, (1,), generator=gen))  # not expert 0: a default must not pass
        logits[:, hot] = logits.max() + 2 * LOGIT_GAP
    elif case.pattern is RouterPattern.TIES:
        logits = torch.stack([_tie_row(e, case.top_k, t, gen) for t in range(m)])
    return logits.float()


def _quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes of float64 `weight` [E, N, K] and their per-(expert, output channel)
    float32 scales [E, N]: absmax / 448, so the codes span the FP8 range. Pure."""
    scale = (weight.abs().amax(dim=-1) / FP8_MAX).float()
    codes = (weight / scale.double()[..., None]).to(torch.float8_e4m3fn)
    return codes, scale


def _junk(rows: int, width: int, dtype: torch.dtype, values: tuple[float, ...]) -> torch.Tensor:
    """[rows, width] cycling through `values` row by row (NaN, infinities, extremes). Pure."""
    column = torch.tensor([values[r % len(values)] for r in range(rows)], dtype=torch.float64)
    return column[:, None].expand(rows, width).to(dtype)


def _junk_logits(rows: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, E] float32 router logits of junk rows: all NaN; one NaN among ordinary values; one
    expert at 1e30; all -inf; all at float32's largest value (a tie). Pure (given `gen`)."""
    big = torch.finfo(torch.float32).max
    out = _ladder(rows, experts, gen).float()
    for r in range(rows):
        kind = r % 5
        if kind == 0:
            out[r] = math.nan
        elif kind == 1:
            out[r, r % experts] = math.nan
        elif kind == 2:
            out[r, (r * 7) % experts] = 1e30
        elif kind == 3:
            out[r] = -math.inf
        else:
            out[r] = big
    return out


def build_inputs(case: MoECase, gen: torch.Generator) -> MoEInputs:
    """The case's inputs on the CPU (see the module docstring). Pure (given `gen`)."""
    m, e, h, i = case.num_tokens, case.num_experts, case.hidden_size, case.intermediate_size
    # gate/up about standard normal; under the clamped SwiGLU about as large as its limit.
    gate_up_std = 1.0 if case.swiglu_limit is None else 0.8 * case.swiglu_limit

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    logits = router_logits(case, gen)
    x = randn(m, h).to(case.dtype)
    w13 = randn(e, 2 * i, h, scale=gate_up_std / math.sqrt(h))
    w13_bias = randn(e, 2 * i, scale=gate_up_std / 2).to(case.dtype) if case.biases else None
    # w2 brings every expert's output to an rms of OUTPUT_RMS whatever the activation's scale
    # (the clamped SwiGLU's is tens of times silu's), measured on this case's own tokens.
    gate_up = torch.einsum("mh,enh->emn", x.double(), w13)
    if w13_bias is not None:
        gate_up = gate_up + w13_bias.double()[:, None, :]
    act_rms = float(activate(gate_up, case.activation, case.swiglu_limit).pow(2).mean().sqrt())
    w2 = randn(e, h, i, scale=OUTPUT_RMS / (act_rms * math.sqrt(i)))
    w2_bias = randn(e, h, scale=0.5).to(case.dtype) if case.biases else None
    if case.fp8_weights:
        (w13_codes, w13_scale), (w2_codes, w2_scale) = _quantized(w13), _quantized(w2)
        experts = ExpertWeights(w13_codes, w2_codes, w13_scale, w2_scale, w13_bias, w2_bias)
    else:
        experts = ExpertWeights(w13.to(case.dtype), w2.to(case.dtype), None, None, w13_bias, w2_bias)
    other = None
    if case.junk_rows:
        j = case.junk_rows
        finfo = torch.finfo(case.dtype)
        junk_x = _junk(j, h, case.dtype, (math.nan, finfo.max, -finfo.max, math.inf, -math.inf))
        # Other junk values at the same routing: finite, ordinary-looking rows.
        other = torch.cat((x, (randn(j, h) * 100).to(case.dtype)))
        x = torch.cat((x, junk_x))
        logits = torch.cat((logits, _junk_logits(j, e, gen)))
    return MoEInputs(x, logits, experts, other)


def _double(experts: ExpertWeights) -> ExpertWeights:
    """The experts as the float64 oracle takes them: FP8 codes and their scales as they are (the
    oracle dequantizes them), everything else widened to float64. Pure."""

    def wide(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.double()

    fp8 = experts.w13_scale is not None
    return ExpertWeights(
        experts.w13 if fp8 else experts.w13.double(),
        experts.w2 if fp8 else experts.w2.double(),
        experts.w13_scale,
        experts.w2_scale,
        wide(experts.w13_bias),
        wide(experts.w2_bias),
    )


# (x, router_logits, experts, routing) -> [M, H] float64: the oracle's operator.
_Formulation = Callable[[torch.Tensor, torch.Tensor, ExpertWeights, MoERouting], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Oracle:
    """The case's step rows as the float64 oracle sees them, and the oracle."""

    x: torch.Tensor  # [M, H] float64
    logits: torch.Tensor  # [M, E] float64
    experts: ExpertWeights
    routing: MoERouting
    op: _Formulation

    def run(self) -> torch.Tensor:
        return self.op(self.x, self.logits, self.experts, self.routing)


def _alternatives(case: MoECase, oracle: _Oracle) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """(cause, the oracle's output under that bug) for the bugs this case can show. Pure."""
    routing, experts = oracle.routing, oracle.experts
    found: list[tuple[str, Callable[[], torch.Tensor]]] = []

    def alt(cause: str, **changes: object) -> None:
        variant = replace(oracle, **changes)  # type: ignore[arg-type]
        found.append((cause, variant.run))

    if bool(
        (oracle.logits[:, :, None] == oracle.logits[:, None, :]).sum(dim=(1, 2)).gt(case.num_experts).any()
    ):
        flipped = ExpertWeights(*(None if t is None else t.flip(0) for t in _fields(experts)))  # type: ignore[arg-type]
        # Reversed experts: a stable pick of the lower index there is the higher index here.
        alt("ties go to the higher expert index", logits=oracle.logits.flip(-1), experts=flipped)
    if routing.scoring == "softmax_topk":
        alt(
            f"renormalize={not routing.renormalize} (the top-k weights "
            + ("not divided by their sum)" if routing.renormalize else "divided by their sum)"),
            routing=replace(routing, renormalize=not routing.renormalize),
        )
        alt("scoring topk_softmax instead of softmax_topk", routing=replace(routing, scoring="topk_softmax"))
    else:
        alt(
            "scoring softmax_topk without renormalization instead of topk_softmax",
            routing=replace(routing, scoring="softmax_topk", renormalize=False),
        )
    if experts.w13_scale is not None and experts.w2_scale is not None:
        ones13, ones2 = torch.ones_like(experts.w13_scale), torch.ones_like(experts.w2_scale)
        alt("the FP8 scales ignored", experts=replace(experts, w13_scale=ones13, w2_scale=ones2))
        alt("w2's FP8 scales ignored", experts=replace(experts, w2_scale=ones2))
    if experts.w13_bias is not None:
        alt("the biases left out", experts=replace(experts, w13_bias=None, w2_bias=None))
        alt("w2_bias left out", experts=replace(experts, w2_bias=None))
    if routing.swiglu_limit is not None:
        alt("the SwiGLU clamp left out", routing=replace(routing, swiglu_limit=math.inf))
    return found


def _fields(experts: ExpertWeights) -> tuple[torch.Tensor | None, ...]:
    return (experts.w13, experts.w2, experts.w13_scale, experts.w2_scale, experts.w13_bias, experts.w2_bias)


def diagnose(
    case: MoECase, got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance, oracle: _Oracle
) -> list[str]:
    """Where the step's rows `got` miss the oracle's `want` (both [M, H] float64), and which
    alternative formulation reproduces them. Pure."""
    weights, ids = select_experts(oracle.logits, oracle.routing)
    bad = (got - want).abs() > tolerance.bound(want)
    bad |= ~torch.isfinite(got)
    rows = bad.any(dim=-1).nonzero().flatten().tolist()
    if not rows:
        return []
    ratio = ((got - want).abs() / tolerance.bound(want)).nan_to_num(math.inf)
    t, c = divmod(int(ratio.argmax()), case.hidden_size)
    counts = torch.bincount(ids.flatten(), minlength=case.num_experts)
    pairs = ", ".join(
        f"{e} (weight {w:.3g}, {int(counts[e])} tokens)"
        for e, w in zip(ids[t].tolist(), weights[t].tolist(), strict=True)
    )
    lines = [
        f"{len(rows)} of {case.num_tokens} rows are wrong; the worst is token {t}, hidden channel {c}: "
        f"got {float(got[t, c]):.6g}, expected {float(want[t, c]):.6g}; its experts: {pairs}"
    ]
    shared = set(ids[rows[0]].tolist()).intersection(*(set(ids[r].tolist()) for r in rows[1:]))
    if shared and len(rows) < case.num_tokens:
        lines.append(f"every wrong row routes to expert {sorted(shared)}")
    error = float((got - want).abs().nan_to_num(math.inf).max())
    for cause, run in _alternatives(case, oracle):
        left = float((got - run()).abs().nan_to_num(math.inf).max())
        if math.isfinite(error) and left <= EXPLAINED * error:
            lines.append(f"hint: the output matches {cause} (max abs err {left:.3g} against that)")
            break
    return lines


def _call(
    kernel: MoEKernel,
    x: torch.Tensor,
    logits: torch.Tensor,
    experts: ExpertWeights,
    routing: MoERouting,
    device: torch.device,
) -> torch.Tensor:
    with torch.no_grad():
        out = kernel.op(x, logits, experts, routing)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return out


def _on(experts: ExpertWeights, device: torch.device) -> ExpertWeights:
    # Copies even on the CPU, so that a kernel writing into its inputs cannot hide it.
    return ExpertWeights(*(None if t is None else t.to(device, copy=True) for t in _fields(experts)))  # type: ignore[arg-type]


def _output_problems(out: object, x: torch.Tensor, what: str) -> list[str]:
    """The output contract: a tensor of x's shape, dtype and device."""
    if not isinstance(out, torch.Tensor):
        return [f"{what} returned {type(out).__name__}, not a tensor"]
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or out.device != x.device:
        return [
            f"{what} returned {tuple(out.shape)} {dtype_name(out.dtype)} on {out.device}, expected x's "
            f"{tuple(x.shape)} {dtype_name(x.dtype)} on {x.device}"
        ]
    return []


def check_moe_case(kernel: MoEKernel, case: MoECase, device: torch.device, oracle: MoEKernel) -> CaseResult:
    """Run `case` on `kernel` (tensors on `device`) and compare with `oracle` in float64. Never
    raises for a failure of `kernel`: exceptions become problems of a FAILED result."""
    gen = torch.Generator().manual_seed(case.seed)
    inputs = build_inputs(case, gen)
    if kernel.logits_in_model_dtype and inputs.x.dtype != torch.float32:
        # As the engine passes them to such a kernel: the router's output in x's dtype, uncast.
        # The ladder's gaps survive bfloat16 and float16 rounding; the oracle reads the rounded
        # values exactly.
        inputs = replace(inputs, router_logits=inputs.router_logits.to(inputs.x.dtype))
    m = case.num_tokens
    reference = _Oracle(
        inputs.x[:m].double(),
        inputs.router_logits[:m].double(),
        _double(inputs.experts),
        case.routing,
        oracle.op,
    )
    want = reference.run()
    tolerance = moe_tolerance_for(case.dtype)
    problems: list[str] = []
    errors: ErrorStats | None = None
    try:
        experts = _on(inputs.experts, device)
        x, logits = inputs.x.to(device, copy=True), inputs.router_logits.to(device, copy=True)
        out = _call(kernel, x, logits, experts, case.routing, device)
        problems += _output_problems(out, x, "op")
        for name, before, after in (
            ("x", inputs.x, x),
            ("router_logits", inputs.router_logits, logits),
            *((f"experts.{n}", b, a) for n, b, a in _named_fields(inputs.experts, experts)),
        ):
            if count_changed(before, after):
                problems.append(f"{name} (an input) was changed")
        runs = [("", out)]
        if inputs.other_junk_x is not None and not problems:
            clean = _call(kernel, x[:m].clone(), logits[:m].clone(), experts, case.routing, device)
            problems += _output_problems(clean, x[:m], "op without the junk rows")
            runs.append((" without the junk rows", clean))
            other = _call(kernel, inputs.other_junk_x.to(device), logits, experts, case.routing, device)
            if not problems:
                problems += junk_rows_problems(
                    out,
                    other,
                    lambda: _call(kernel, x, logits, experts, case.routing, device),
                    m,
                    "only the junk rows of x held other values (same router logits)",
                )
        if not problems:
            problems, errors = judge_runs(
                runs,
                m,
                want,
                tolerance,
                f"{dtype_name(case.dtype)} MoE",
                lambda got: diagnose(case, got, want, tolerance, reference),
            )
    except Exception as e:
        problems.append(f"op raised {type(e).__name__}: {e}")
    status = Status.FAILED if problems else Status.PASSED
    return CaseResult(COMPONENT, case, status, tuple(problems), errors)


def _named_fields(
    before: ExpertWeights, after: ExpertWeights
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    names = ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")
    return [
        (n, b, a)
        for n, b, a in zip(names, _fields(before), _fields(after), strict=True)
        if b is not None and a is not None
    ]
