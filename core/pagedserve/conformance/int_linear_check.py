"""Running one `IntLinearCase` on a platform's `IntLinearKernel` and comparing with the float64
formulation.

Inputs (drawn from the case's seed):

* Codes uniform over the whole `bits`-bit range (the top code sets bit 31 of a word, the lowest is
  stored as 0); zero points (when the case has them) uniform over the signed range, so ignoring,
  negating or offsetting them moves every weight by many scales.
* Scales: each group's own factor in [0.5, 2) times one constant that brings the output to an rms
  of about 1 for standard-normal x (the tolerance's absolute term then means what it says), rounded
  to float16 values as GPTQ and AWQ checkpoints store them: `(q - z) * s` is then exact in float32,
  as the contract assumes, so the oracle's weight is the kernel's. Neighbouring groups' scales
  differ by about half, so a wrong group index is far outside any tolerance.
* The last word of a row whose codes do not fill it holds random bits past the K-th code.
* x standard normal in the case's dtype; a bias (when the case has one) normal with std 0.5.
* Junk rows (`IntLinearCase.junk_rows`): rows of x past the step's rows holding NaN, +-inf and the
  dtype's largest values, as a CUDA graph's padding may.

x, the scales and the bias are handed over inside poisoned (NaN) allocations (`GuardedTensor`):
reading past either end of them turns outputs into NaN, writing there is reported.

Checks, in this order of reporting: the call must not raise; it must return a tensor of [rows of
x, N] in x's dtype on x's device; it must leave every input unchanged (bitwise) and write nothing
outside them; the step's rows must be finite and within the integer-linear tolerance
(`INT_LINEAR_TOLERANCES`) of the oracle, `IntLinearKernel.op` of cpu_reference run on the same
(rounded) x and bias in float64 on the CPU, whose weight is therefore not rounded to x's dtype.
Rows past the step are not compared. With junk rows: the call without them must pass the same
checks, and a second call whose junk rows hold other values must return the step's rows bit for
bit (bits, not a tolerance: it is otherwise exactly the same computation).

A failure beyond tolerance names its worst element (row and output channel), the range of output
channels that are wrong, and the alternative formulation that reproduces the output, if one does
(zero points ignored or added, the codes' offset left out or taken for the other width, the scales
indexed with another group size, the partial last group left out, the bias left out or added
twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.conformance.cases import dtype_name
from pagedserve.conformance.guards import GuardedTensor, count_changed
from pagedserve.conformance.int_linear_cases import GROUP_SIZES, IntLinearCase
from pagedserve.conformance.judging import judge_runs, junk_rows_problems
from pagedserve.conformance.results import CaseResult, ErrorStats, Status
from pagedserve.conformance.tolerances import Tolerance, int_linear_tolerance_for
from pagedserve.platforms.api import IntLinearKernel, PackedIntWeight
from pagedserve.quantization.int_formats import pack_codes, unpack_codes

COMPONENT = "int_linear"
FACTOR_RANGE = (0.5, 2.0)  # each group's scale factor: neighbours differ by about half
BIAS_STD = 0.5
EXPLAINED = 0.2  # an alternative explains the output when it leaves at most this share of the error


@dataclass(frozen=True, slots=True)
class IntLinearInputs:
    """A case's inputs on the CPU, as the kernel receives them (junk rows included)."""

    x: torch.Tensor  # [M + junk, K], the case's dtype
    weight: PackedIntWeight  # codes, float32 scales, int8 zeros or None
    bias: torch.Tensor | None  # [N], the case's dtype
    other_junk_x: torch.Tensor | None  # x with other values in its junk rows; None without junk rows


def _junk(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, width] cycling through NaN, the dtype's extremes and the infinities row by row. Pure."""
    finfo = torch.finfo(dtype)
    values = (math.nan, finfo.max, -finfo.max, math.inf, -math.inf)
    column = torch.tensor([values[r % len(values)] for r in range(rows)], dtype=torch.float64)
    return column[:, None].expand(rows, width).to(dtype)


def _junk_padding(packed: torch.Tensor, bits: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`packed` with random bits past the K-th code of each row's last word (unchanged when the
    codes fill it). Pure (given `gen`)."""
    used = (k % (32 // bits)) * bits  # bits of the last word holding codes
    if used == 0:
        return packed
    n = packed.shape[0]
    last = packed[:, -1].to(torch.int64) & 0xFFFFFFFF
    junk = torch.randint(0, 1 << (32 - used), (n,), generator=gen, dtype=torch.int64) << used
    word = (last & ((1 << used) - 1)) | junk
    out = packed.clone()
    out[:, -1] = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return out


def build_inputs(case: IntLinearCase, gen: torch.Generator) -> IntLinearInputs:
    """The case's inputs on the CPU (see the module docstring). Pure (given `gen`)."""
    m, n, k, bits = case.num_tokens, case.out_features, case.in_features, case.bits
    half = 1 << (bits - 1)
    groups = case.num_groups
    stored = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.int64)
    zeros = (
        torch.randint(-half, half, (n, groups), generator=gen, dtype=torch.int64).to(torch.int8)
        if case.zero_points
        else None
    )
    low, high = FACTOR_RANGE
    factors = low + (high - low) * torch.rand(n, groups, generator=gen, dtype=torch.float64)
    index = torch.arange(k) // case.weight_group_size
    values = (stored - half).double()
    if zeros is not None:
        values = values - zeros.double()[:, index]
    # One constant for the whole weight: every row's rms stays its own, the output's is about 1.
    unit = float((values * factors[:, index]).pow(2).mean().mul(k).sqrt())
    scales = (factors / unit).to(torch.float16).float()
    packed = _junk_padding(pack_codes(stored, bits), bits, k, gen)
    weight = PackedIntWeight(packed, scales, zeros, bits, case.weight_group_size, k)
    x = torch.randn(m, k, generator=gen, dtype=torch.float64).to(case.dtype)
    bias = (
        (torch.randn(n, generator=gen, dtype=torch.float64) * BIAS_STD).to(case.dtype) if case.bias else None
    )
    other = None
    if case.junk_rows:
        j = case.junk_rows
        other = torch.cat((x, (torch.randn(j, k, generator=gen, dtype=torch.float64) * 100).to(case.dtype)))
        x = torch.cat((x, _junk(j, k, case.dtype)))
    return IntLinearInputs(x, weight, bias, other)


def weight_float64(
    weight: PackedIntWeight,
    *,
    group_size: int | None = None,  # index the scales (and zeros) as groups of this many inputs
    offset: int | None = None,  # subtracted from the stored codes; None: 2**(bits-1)
    zero_sign: float = 1.0,  # 0: zero points ignored; -1: added instead of subtracted
    inputs: int | None = None,  # inputs [0, inputs) count, the others are left out
) -> torch.Tensor:
    """`weight` [N, K] in float64, exactly or as one plausible bug computes it (the keywords).
    Scales and zeros are read as a kernel's pointer arithmetic reads them (row n's group g at
    n * G + g), so a wrong group index reads the next row's, and past the last row the last
    element. Pure."""
    k, bits = weight.in_features, weight.bits
    n, g = weight.scales.shape
    codes = unpack_codes(weight.packed, bits, k, dim=1).double()
    codes = codes - ((1 << (bits - 1)) if offset is None else offset)
    size = weight.group_size if group_size is None else group_size
    cells = (torch.arange(n)[:, None] * g + torch.arange(k)[None, :] // size).clamp(max=n * g - 1)
    if weight.zeros is not None and zero_sign:
        codes = codes - zero_sign * weight.zeros.double().flatten()[cells]
    w = codes * weight.scales.double().flatten()[cells]
    if inputs is not None:
        w[:, inputs:] = 0.0
    return w


@dataclass(frozen=True, slots=True)
class _Oracle:
    """The case's step rows as the float64 oracle sees them, and the oracle."""

    x: torch.Tensor  # [M, K] float64
    weight: PackedIntWeight
    bias: torch.Tensor | None  # [N] float64
    op: Callable[[torch.Tensor, PackedIntWeight, torch.Tensor | None], torch.Tensor]

    def run(self) -> torch.Tensor:
        return self.op(self.x, self.weight, self.bias)


def _alternatives(case: IntLinearCase, oracle: _Oracle) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """(cause, the output under that bug) for the bugs this case can show. Pure."""
    x, weight, bias = oracle.x, oracle.weight, oracle.bias
    found: list[tuple[str, Callable[[], torch.Tensor]]] = []

    def alt(cause: str, bias_times: float = 1.0, **changes: object) -> None:
        def run() -> torch.Tensor:
            out = x @ weight_float64(weight, **changes).T  # type: ignore[arg-type]
            return out if bias is None else out + bias_times * bias

        found.append((cause, run))

    if weight.zeros is not None:
        alt("the zero points ignored", zero_sign=0.0)
        alt("the zero points added instead of subtracted", zero_sign=-1.0)
    alt(f"the codes read without their offset of 2**{case.bits - 1}", offset=0)
    other = 4 if case.bits == 8 else 8
    alt(
        f"the {case.bits}-bit codes offset by 2**{other - 1} (the {other}-bit offset)",
        offset=1 << (other - 1),
    )
    k, size = case.in_features, case.weight_group_size
    for wrong in sorted({*GROUP_SIZES, k} - {size}):
        label = "one group per output channel" if wrong == k else f"groups of {wrong} inputs"
        alt(f"the scales indexed as {label} instead of {case.group_label}", group_size=wrong)
    if k % size:
        alt(f"the partial last group (inputs {k - k % size}..{k - 1}) left out", inputs=k - k % size)
    if bias is not None:
        alt("the bias left out", bias_times=0.0)
        alt("the bias added twice", bias_times=2.0)
    return found


def diagnose(
    case: IntLinearCase, got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance, oracle: _Oracle
) -> list[str]:
    """Where the step's rows `got` miss the oracle's `want` (both [M, N] float64), and which
    alternative formulation reproduces them. Pure."""
    bad = (got - want).abs() > tolerance.bound(want)
    bad |= ~torch.isfinite(got)
    if not bool(bad.any()):
        return []
    ratio = ((got - want).abs() / tolerance.bound(want)).nan_to_num(math.inf)
    m, n = divmod(int(ratio.argmax()), case.out_features)
    rows, columns = int(bad.any(dim=1).sum()), int(bad.any(dim=0).sum())
    lines = [
        f"{int(bad.sum())} elements in {rows} of {case.num_tokens} rows and {columns} of "
        f"{case.out_features} output channels are wrong; the worst is row {m}, output channel {n}: "
        f"got {float(got[m, n]):.6g}, expected {float(want[m, n]):.6g}"
    ]
    if 0 < columns < case.out_features:
        wrong = bad.any(dim=0).nonzero().flatten()
        lines.append(f"the wrong output channels lie in {int(wrong.min())}..{int(wrong.max())}")
    error = float((got - want).abs().nan_to_num(math.inf).max())
    if not math.isfinite(error):
        return lines
    # The best explanation, not the first: several bugs move the weights the same way (an offset
    # of 8 is close to none at all next to 128), and only the closest names the one at hand.
    left, cause = min(
        (
            (float((got - run()).abs().nan_to_num(math.inf).max()), cause)
            for cause, run in _alternatives(case, oracle)
        ),
        default=(math.inf, ""),
    )
    if left <= EXPLAINED * error:
        lines.append(f"hint: the output matches {cause} (max abs err {left:.3g} against that)")
    return lines


@dataclass(frozen=True, slots=True)
class _Placed:
    """A case's inputs on the device, x, the scales and the bias inside poisoned allocations."""

    x: GuardedTensor
    scales: GuardedTensor
    bias: GuardedTensor | None
    weight: PackedIntWeight  # its scales are `scales.tensor`

    def margins_changed(self) -> int:
        guards = (self.x, self.scales, self.bias)
        return sum(g.margins_changed() for g in guards if g is not None)


def _guarded(t: torch.Tensor, device: torch.device) -> GuardedTensor:
    g = GuardedTensor(tuple(t.shape), t.dtype, device, margin=max(t.shape[-1], 1))
    g.tensor.copy_(t)
    return g


def _place(inputs: IntLinearInputs, device: torch.device) -> _Placed:
    # Copies even on the CPU, so that a kernel writing into its inputs cannot hide it.
    w = inputs.weight
    scales = _guarded(w.scales, device)
    zeros = None if w.zeros is None else w.zeros.to(device, copy=True)
    weight = PackedIntWeight(
        w.packed.to(device, copy=True), scales.tensor, zeros, w.bits, w.group_size, w.in_features
    )
    bias = None if inputs.bias is None else _guarded(inputs.bias, device)
    return _Placed(_guarded(inputs.x, device), scales, bias, weight)


def _call(
    kernel: IntLinearKernel,
    x: torch.Tensor,
    weight: PackedIntWeight,
    bias: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    with torch.no_grad():
        out = kernel.op(x, weight, bias)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return out


def _output_problems(out: object, x: torch.Tensor, n: int, what: str) -> list[str]:
    """The output contract: a tensor of [rows of x, N] in x's dtype on x's device."""
    if not isinstance(out, torch.Tensor):
        return [f"{what} returned {type(out).__name__}, not a tensor"]
    shape = (x.shape[0], n)
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device:
        return [
            f"{what} returned {tuple(out.shape)} {dtype_name(out.dtype)} on {out.device}, expected "
            f"{shape} {dtype_name(x.dtype)} on {x.device}"
        ]
    return []


def _changed_inputs(inputs: IntLinearInputs, placed: _Placed) -> list[str]:
    w, p = inputs.weight, placed.weight
    pairs = [("x", inputs.x, placed.x.tensor), ("packed", w.packed, p.packed), ("scales", w.scales, p.scales)]
    if w.zeros is not None and p.zeros is not None:
        pairs.append(("zeros", w.zeros, p.zeros))
    if inputs.bias is not None and placed.bias is not None:
        pairs.append(("bias", inputs.bias, placed.bias.tensor))
    problems = [
        f"{name} (an input) was changed" for name, before, after in pairs if count_changed(before, after)
    ]
    changed = placed.margins_changed()
    if changed:
        problems.append(f"wrote {changed} elements outside x, the scales or the bias (out-of-bounds write)")
    return problems


def check_int_linear_case(
    kernel: IntLinearKernel, case: IntLinearCase, device: torch.device, oracle: IntLinearKernel
) -> CaseResult:
    """Run `case` on `kernel` (tensors on `device`) and compare with `oracle` in float64. Never
    raises for a failure of `kernel`: exceptions become problems of a FAILED result."""
    gen = torch.Generator().manual_seed(case.seed)
    inputs = build_inputs(case, gen)
    m, n = case.num_tokens, case.out_features
    reference = _Oracle(
        inputs.x[:m].double(),
        inputs.weight,
        None if inputs.bias is None else inputs.bias.double(),
        oracle.op,
    )
    want = reference.run()
    tolerance = int_linear_tolerance_for(case.dtype)
    problems: list[str] = []
    errors: ErrorStats | None = None
    try:
        placed = _place(inputs, device)
        bias = None if placed.bias is None else placed.bias.tensor
        x = placed.x.tensor
        out = _call(kernel, x, placed.weight, bias, device)
        problems += _output_problems(out, x, n, "op")
        problems += _changed_inputs(inputs, placed)
        runs = [("", out)]
        if inputs.other_junk_x is not None and not problems:
            clean = _call(kernel, x[:m].clone(), placed.weight, bias, device)
            problems += _output_problems(clean, x[:m], n, "op without the junk rows")
            runs.append((" without the junk rows", clean))
            other = _call(kernel, inputs.other_junk_x.to(device), placed.weight, bias, device)
            if not problems:
                problems += junk_rows_problems(
                    out,
                    other,
                    lambda: _call(kernel, x, placed.weight, bias, device),
                    m,
                    "only the junk rows of x held other values",
                )
        if not problems:
            problems, errors = judge_runs(
                runs,
                m,
                want,
                tolerance,
                f"{dtype_name(case.dtype)} integer-linear",
                lambda got: diagnose(case, got, want, tolerance, reference),
            )
    except Exception as e:
        problems.append(f"op raised {type(e).__name__}: {e}")
    status = Status.FAILED if problems else Status.PASSED
    return CaseResult(COMPONENT, case, status, tuple(problems), errors)
