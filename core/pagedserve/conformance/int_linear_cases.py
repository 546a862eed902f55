"""The integer-weight linear op's cases (`IntLinearCase`): which shapes, widths and group sizes a
platform's `IntLinearKernel` is run on (`int_linear_check` builds and judges them).

The cases are sweeps from one base call, each group varying one property of the weight or the
call away from it, so that a bug in one property fails exactly one group (the suite's own tests
plant one per group). The base: 16 rows (a CUDA graph's batch of decodes), 256 -> 128 features
(multiples of every tile a kernel is likely to use), the kernel's first declared width of 4 and 8
bits, groups of 128 inputs (GPTQ's and AWQ's default; else the first of 64, 32 the kernel takes,
else one group per output channel), symmetric codes, no bias, the platform's first dtype of
float32, float16, bfloat16. The number of rows is not a group property: each group runs a decode
and a prefill where it matters.

* `group_size`: groups of 32 and 64 inputs, the smallest group the kernel declares
  (`group_multiple`), one group per output channel (at K = 256 and at K = 200, which no power of
  two above 8 divides: kernels that step through K in tiles gather each input's group there).
* `zero_points`: signed int8 zero points over the codes' whole range (AWQ, asymmetric GPTQ and
  compressed-tensors), at 1, 16 and 64 rows.
* `bits`: the other declared width (8 bits after a base of 4), at 1, 16 and 64 rows.
* `dtype`: each other activation dtype of the platform, at 16 and 64 rows (full: also 1), over
  K = 1024 inputs: a sum over K rounded in a 16-bit type (instead of float32) then misses the
  16-bit rows by twice or more even at one row.
* `odd_shapes`: row counts 1 to 300 across the 16- and 64-row tiles, output widths off every
  power-of-two tile, and input widths with a partial last group and a partly filled last word of
  codes (whose unused bits hold junk: the contract defines codes 0 .. K-1 only).
* `junk_rows`: rows of x past the step's rows holding NaN, infinities and the dtype's extremes,
  as a CUDA graph's padding may; they must change nothing in the step's rows.
* `bias`: a bias in x's dtype, at 16 and 64 rows.

Activation order (`g_idx`) has no group: `PackedIntWeight` carries none; the engine stores an
activation-ordered layer's columns in group order and permutes its inputs before the op
(`IntWeightLinear.sort_inputs`), or keeps it on the core's formulation. Only what the
kernel declares is drawn: widths in `IntLinearKernel.bits` and group sizes `takes()` accepts; the
engine passes it nothing else, so there is nothing to probe.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve.conformance.cases import BASE_DTYPE_PREFERENCE, _seed, dtype_name
from pagedserve.platforms.api import IntLinearKernel, PackedIntWeight

INT_LINEAR_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the engine serves them in
INT_LINEAR_BITS = (4, 8)  # the code widths `PackedIntWeight` defines
GROUP_SIZES = (32, 64, 128)  # checkpoints' group sizes (besides one group per output channel)
BASE_GROUP_PREFERENCE = (128, 64, 32)
BASE_ROWS, BASE_OUT, BASE_IN = 16, 128, 256
DTYPE_IN = 1024  # the `dtype` cases' K: long sums, where the accumulator's rounding shows
# (rows, outputs, inputs, in the quick set) of `odd_shapes`: no output width a multiple of 32 or
# input width of 64, every input width with a partial last group of 128 and a partial last word.
ODD_SHAPES = (
    (1, 97, 300, True),
    (3, 33, 138, True),
    (17, 200, 330, True),
    (64, 40, 196, False),
    (129, 72, 270, True),
    (300, 50, 150, False),
)


@dataclass(frozen=True, slots=True)
class IntLinearCase:
    """One call of a platform's `IntLinearKernel.op`, compared with the float64 formulation."""

    group: str  # "group_size", "zero_points", "bits", "dtype", "odd_shapes", "junk_rows", "bias"
    variant: str
    num_tokens: int  # M: the step's rows of x (before any junk rows)
    out_features: int  # N
    in_features: int  # K
    bits: int  # 4 or 8
    group_size: int | None  # inputs per scale; None: one group per output channel (K)
    zero_points: bool  # int8 zero points per group; False: symmetric (`zeros` None)
    dtype: torch.dtype  # x, the bias and the output
    bias: bool
    seed: int
    junk_rows: int = 0  # rows of x past the step's rows, holding NaN and huge values

    @property
    def case_id(self) -> str:
        return f"{self.group}[{self.variant}]"

    @property
    def weight_group_size(self) -> int:
        """`PackedIntWeight.group_size`: K for one group per output channel."""
        return self.in_features if self.group_size is None else self.group_size

    @property
    def num_groups(self) -> int:
        return -(-self.in_features // self.weight_group_size)

    @property
    def group_label(self) -> str:
        """ "channel" or the group size, for people."""
        return "channel" if self.group_size is None else str(self.group_size)

    @property
    def description(self) -> str:
        groups = "per channel" if self.group_size is None else f"groups of {self.group_size}"
        options = ["zero points" if self.zero_points else "symmetric"]
        if self.bias:
            options.append("bias")
        if self.junk_rows:
            options.append(f"+{self.junk_rows} junk rows")
        return (
            f"int linear: rows={self.num_tokens} {self.in_features}->{self.out_features} int{self.bits} "
            f"{groups} {dtype_name(self.dtype)} " + " ".join(options)
        )

    def taken_by(self, kernel: IntLinearKernel) -> bool:
        """Whether `kernel` declares this case's weight (`IntLinearKernel.takes`). Pure."""
        return kernel.takes(header(self.bits, self.weight_group_size, self.in_features))


def header(bits: int, group_size: int, in_features: int) -> PackedIntWeight:
    """A weight without codes: what `IntLinearKernel.takes` reads (width and group size). Pure."""
    empty = torch.empty(0, dtype=torch.int32)
    return PackedIntWeight(empty, torch.empty(0), None, bits, group_size, in_features)


def int_linear_cases(
    kernel: IntLinearKernel, dtypes: Iterable[torch.dtype], *, quick: bool, seed: int = 0
) -> list[IntLinearCase]:
    """The cases of `kernel` on a platform computing in `dtypes` (module docstring): only widths
    and group sizes the kernel declares. Empty when it declares neither 4 nor 8 bits. Pure."""
    widths = [b for b in INT_LINEAR_BITS if b in kernel.bits]
    if not widths:
        return []
    bits = widths[0]
    dtype_list = [d for d in INT_LINEAR_DTYPES if d in set(dtypes)]
    d0 = next((d for d in BASE_DTYPE_PREFERENCE if d in dtype_list), torch.float32)

    def takes(size: int, k: int = BASE_IN, width: int = bits) -> bool:
        return kernel.takes(header(width, size, k))

    group = next((g for g in BASE_GROUP_PREFERENCE if takes(g)), None)
    base = IntLinearCase(
        group="",
        variant="",
        num_tokens=BASE_ROWS,
        out_features=BASE_OUT,
        in_features=BASE_IN,
        bits=bits,
        group_size=group,
        zero_points=False,
        dtype=d0,
        bias=False,
        seed=0,
    )
    cases: list[IntLinearCase] = []

    def add(group_: str, variant: str, *, full_only: bool = False, **changes: Any) -> None:
        case = replace(
            base, group=group_, variant=variant, seed=_seed(f"int_linear/{group_}[{variant}]", seed)
        )
        case = replace(case, **changes)
        if not (full_only and quick) and case.taken_by(kernel):
            cases.append(case)

    sizes = sorted({g for g in (*GROUP_SIZES, kernel.group_multiple) if 1 < g < BASE_IN and takes(g)})
    for size in sizes:
        if size != group:
            add("group_size", f"g{size}", group_size=size, num_tokens=64 if size == 64 else BASE_ROWS)
    if group is not None:
        add("group_size", "channel", group_size=None, num_tokens=1)
        add("group_size", "channel_k200", group_size=None, in_features=200, num_tokens=5)
    for rows, name in ((1, "decode"), (BASE_ROWS, f"m{BASE_ROWS}"), (64, "prefill")):
        add("zero_points", f"int{bits}_{name}", zero_points=True, num_tokens=rows)
    for width in widths[1:]:
        for rows, name in ((1, "decode"), (BASE_ROWS, f"m{BASE_ROWS}"), (64, "prefill")):
            add("bits", f"int{width}_{name}", bits=width, num_tokens=rows)
    for d in dtype_list:
        if d != d0:
            wide: dict[str, Any] = {"dtype": d, "in_features": DTYPE_IN}
            add("dtype", f"{dtype_name(d)}_decode", full_only=True, num_tokens=1, out_features=256, **wide)
            add("dtype", dtype_name(d), **wide)
            add("dtype", f"{dtype_name(d)}_prefill", num_tokens=64, **wide)
    for m, n, k, in_quick in ODD_SHAPES:
        add(
            "odd_shapes",
            f"m{m}_n{n}_k{k}",
            full_only=not in_quick,
            num_tokens=m,
            out_features=n,
            in_features=k,
        )
    # Padding to a CUDA graph's batch size: 3 rows in a graph of 16, 45 in one of 64.
    add("junk_rows", "decode", num_tokens=3, junk_rows=13)
    add("junk_rows", "prefill", num_tokens=45, junk_rows=19)
    add("bias", f"m{BASE_ROWS}", bias=True)
    add("bias", "prefill", bias=True, num_tokens=64)
    return cases
