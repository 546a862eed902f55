"""Turning results into what people read: per-group summaries with the worst case, the text table of
`pagedserve conformance`, its JSON, and the generated markdown support matrix."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from pagedserve.conformance.cases import (
    AttentionCase,
    EngineCase,
    LoRACase,
    MoECase,
    RouterPattern,
    dtype_name,
)
from pagedserve.conformance.int_linear_cases import IntLinearCase
from pagedserve.conformance.results import CaseResult, Status


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What was run, for headers: enough to reproduce the run."""

    platform: str
    device_type: str  # "cuda", "cpu", ...: the support matrix keeps one section per platform and type
    device: str  # for people: "cuda:0 (NVIDIA H100 80GB HBM3)", "cpu (CPU test mode)"
    quick: bool
    command: str  # the command that reproduces the run

    @property
    def section_key(self) -> str:
        return f"platform={self.platform} device={self.device_type}"


@dataclass(frozen=True, slots=True)
class GroupSummary:
    """The results of one case group of one component."""

    component: str
    group: str
    passed: int
    failed: int
    unsupported: int
    worst: CaseResult | None  # the compared case with the largest err/tol; None when none was compared


def summarize(results: Iterable[CaseResult]) -> list[GroupSummary]:
    """One summary per (component, group), in first-seen order. Pure."""
    by_group: dict[tuple[str, str], list[CaseResult]] = {}
    for r in results:
        by_group.setdefault((r.component, r.group), []).append(r)
    summaries = []
    for (component, group), members in by_group.items():
        compared = [r for r in members if r.errors is not None]
        worst = max(compared, key=lambda r: r.errors.worst_ratio if r.errors else 0.0, default=None)
        summaries.append(
            GroupSummary(
                component=component,
                group=group,
                passed=sum(r.status is Status.PASSED for r in members),
                failed=sum(r.status is Status.FAILED for r in members),
                unsupported=sum(r.status is Status.UNSUPPORTED for r in members),
                worst=worst,
            )
        )
    return summaries


def _worst_cells(s: GroupSummary) -> list[str]:
    if s.worst is None or s.worst.errors is None:
        return ["-", "-", "-"]
    e = s.worst.errors
    return [s.worst.case.case_id, f"{e.max_abs_err:.2g}", f"{e.worst_ratio:.2g}"]


def pattern_hints(results: list[CaseResult]) -> list[str]:
    """Hints from which cases of an attention backend fail and which pass: only window cases, only
    GQA ratios above 1, only one dtype, only FP8 caches, only batches with multi-token queries,
    only calls without `out=`, only the engine smoke check; and of an MoE kernel: only FP8 experts,
    only the SwiGLU, only tied logits, only junk rows, only one dtype; and of an integer-weight
    linear kernel: only zero points, one code width, some group sizes, partial last groups, odd
    widths, junk rows, a bias, some dtypes. Pure."""
    hints = []
    for component in dict.fromkeys(r.component for r in results):
        mine = [r for r in results if r.component == component and r.status is not Status.UNSUPPORTED]
        failed = [r for r in mine if r.status is Status.FAILED]
        passed = [r for r in mine if r.status is Status.PASSED]
        if not failed or not passed:
            continue
        moe_failed = [r.case for r in failed if isinstance(r.case, MoECase)]
        if moe_failed:
            moe_found = _moe_pattern(moe_failed, [r.case for r in passed if isinstance(r.case, MoECase)])
            if moe_found is not None:
                hints.append(f"{component}: {moe_found}")
            continue
        int_failed = [r.case for r in failed if isinstance(r.case, IntLinearCase)]
        if int_failed:
            int_passed = [r.case for r in passed if isinstance(r.case, IntLinearCase)]
            int_found = _int_linear_pattern(int_failed, int_passed)
            if int_found is not None:
                hints.append(f"{component}: {int_found}")
            continue
        kernel_failed = [r.case for r in failed if isinstance(r.case, AttentionCase)]
        kernel_passed = [r.case for r in passed if isinstance(r.case, AttentionCase)]
        if not kernel_failed:
            if any(isinstance(r.case, EngineCase) for r in failed):
                hints.append(
                    f"{component}: every kernel case passes but the engine smoke check fails: look at what "
                    "forward returns (dtype, shape, `out`) and at state kept between calls"
                )
            continue
        found = _kernel_pattern(kernel_failed, kernel_passed)
        if found is not None:
            hints.append(f"{component}: {found}")
    return hints


def _kernel_pattern(failed: list[AttentionCase], passed: list[AttentionCase]) -> str | None:
    def only(pred: Callable[[AttentionCase], bool]) -> bool:
        return all(pred(c) for c in failed) and not all(pred(c) for c in passed)

    # First: sink cases run with windows, softcaps and FP8 caches too.
    if only(lambda c: c.attention_sinks):
        return (
            "only attention-sink cases fail: look at the sink's term of the softmax (once per row "
            "however the keys are split, in the running maximum too, not scaled or softcapped)"
        )
    if only(lambda c: c.sliding_window is not None):
        return "only sliding-window cases fail: look at the window mask"
    if only(lambda c: c.logit_softcap is not None):
        return "only softcap cases fail: look at the softcap"
    if only(lambda c: c.kv_cache_dtype is not None):
        return "only FP8 KV-cache cases fail: look at the dequantization and its scales"
    if only(lambda c: not c.pass_out):
        return "only cases without out= fail: look at the tensor forward allocates and returns"
    # Before the shape patterns: every base case has GQA ratio 2 and multi-token queries.
    dtypes = {c.dtype for c in failed}
    if len(dtypes) == 1 and only(lambda c: c.dtype in dtypes):
        return f"only {dtype_name(next(iter(dtypes)))} cases fail: look at that dtype's path"
    if only(lambda c: c.num_q_heads > c.num_kv_heads) and any(
        c.num_q_heads == c.num_kv_heads for c in passed
    ):
        return (
            "only cases with GQA ratio > 1 fail (ratio 1 passes): look at the query-head -> KV-head mapping"
        )
    if only(lambda c: max(c.geometry.query_lens) > 1) and any(
        max(c.geometry.query_lens) == 1 for c in passed
    ):
        return "only batches with multi-token queries fail (decodes pass): look at the causal mask"
    return None


def _moe_pattern(failed: list[MoECase], passed: list[MoECase]) -> str | None:
    def only(pred: Callable[[MoECase], bool]) -> bool:
        return all(pred(c) for c in failed) and not all(pred(c) for c in passed)

    if only(lambda c: c.fp8_weights):
        return "only FP8-weight cases fail: look at the dequantization and its per-channel scales"
    if only(lambda c: c.activation == "swiglu_limit"):
        return "only the clamped-SwiGLU cases fail: look at the biases and the clamp"
    if only(lambda c: c.pattern is RouterPattern.TIES):
        return "only tied router logits fail: among equal scores the lower expert index wins"
    if only(lambda c: c.junk_rows > 0):
        return (
            "only cases with junk rows past the step fail: look at what reads across rows (a max or "
            "sum over the batch, the sorted tokens' padding, per-expert buffers sized by the batch)"
        )
    dtypes = {c.dtype for c in failed}
    if len(dtypes) == 1 and only(lambda c: c.dtype in dtypes):
        return f"only {dtype_name(next(iter(dtypes)))} cases fail: look at that dtype's path"
    return None


def _int_linear_pattern(failed: list[IntLinearCase], passed: list[IntLinearCase]) -> str | None:
    # Stricter than the attention and MoE patterns: the property must hold for every failing case
    # and for no passing one. Every case has some width, group size and dtype (the base's, most of
    # them), so "not all passing cases have it" would name the base's values for any bug.
    def only(pred: Callable[[IntLinearCase], bool]) -> bool:
        return all(pred(c) for c in failed) and not any(pred(c) for c in passed)

    def names(values: set[str]) -> str:
        return ", ".join(sorted(values, key=_sort_key))

    if only(lambda c: c.junk_rows > 0):
        return (
            "only cases with junk rows past the step fail: look at what reads across rows (a max or "
            "sum over the batch, such as an activation scale, or a row tile's mask)"
        )
    if only(lambda c: c.zero_points):
        return (
            "only cases with zero points fail: look at the zero points (int8, signed like the codes, "
            "subtracted from them)"
        )
    if only(lambda c: c.bias):
        return (
            "only cases with a bias fail: look at the bias (x's dtype, added once before the output's "
            "rounding)"
        )
    widths = {c.bits for c in failed}
    if len(widths) == 1 and only(lambda c: c.bits in widths):
        bits = next(iter(widths))
        return (
            f"only int{bits} cases fail: look at how {bits}-bit codes are unpacked ({32 // bits} to a word) "
            f"and their offset of 2**{bits - 1}"
        )
    if only(lambda c: c.in_features % c.weight_group_size != 0):
        return (
            "only input widths with a partial last group fail: look at the group count "
            "ceil(K / group_size) and the mask of the last K step"
        )
    sizes = {c.group_label for c in failed}
    if only(lambda c: c.group_label in sizes):
        return (
            f"only group sizes {names(sizes)} fail: look at the group index k // group_size of the "
            "scales (and zeros), and the row stride of the scales"
        )
    if only(lambda c: c.out_features % 32 != 0 or c.in_features % 64 != 0):
        return "only widths off the power-of-two tiles fail: look at the masks of the last N and K tiles"
    dtypes = {c.dtype for c in failed}
    if only(lambda c: c.dtype in dtypes):
        return (
            f"only {names({dtype_name(d) for d in dtypes})} cases fail: look at that dtype's path (a "
            "float32 accumulator, the weight rounded once to x's dtype)"
        )
    return None


def format_text(info: RunInfo, results: list[CaseResult]) -> str:
    """The CLI's report: every failure in full, hints from the pattern of failures, then one table
    per component."""
    lines = []
    failures = [r for r in results if r.status is Status.FAILED]
    for r in failures:
        lines.append(r.summary())
    lines += [f"hint: {h}" for h in pattern_hints(results)]
    if failures:
        lines.append("")
    mode = "quick" if info.quick else "full"
    lines.append(f"Conformance of platform {info.platform!r} on {info.device} ({mode} case set)")
    header = ["case group", "passed", "failed", "unsupported", "worst case", "max abs err", "err/tol"]
    summaries = summarize(results)
    for component in dict.fromkeys(s.component for s in summaries):
        rows = [
            [s.group, str(s.passed), str(s.failed), str(s.unsupported), *_worst_cells(s)]
            for s in summaries
            if s.component == component
        ]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines.append("")
        lines.append(component)
        for row in [header, *rows]:
            lines.append(
                "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            )
    counts = {status: sum(r.status is status for r in results) for status in Status}
    lines.append("")
    lines.append(
        f"{len(results)} cases: {counts[Status.PASSED]} passed, {counts[Status.FAILED]} failed, "
        f"{counts[Status.UNSUPPORTED]} unsupported"
    )
    return "\n".join(lines)


def to_json(info: RunInfo, results: list[CaseResult]) -> dict[str, Any]:
    """The report as plain data (`--json`)."""
    return {
        "platform": info.platform,
        "device_type": info.device_type,
        "device": info.device,
        "quick": info.quick,
        "results": [
            {
                "id": r.item_id,
                "component": r.component,
                "group": r.group,
                "case": r.case.case_id,
                "description": r.case.description,
                "status": r.status.value,
                "problems": list(r.problems),
                "note": r.note,
                "max_abs_err": r.errors.max_abs_err if r.errors else None,
                "max_rel_err": r.errors.max_rel_err if r.errors else None,
                "err_over_tol": r.errors.worst_ratio if r.errors else None,
            }
            for r in results
        ],
        "groups": [
            {
                "component": s.component,
                "group": s.group,
                "passed": s.passed,
                "failed": s.failed,
                "unsupported": s.unsupported,
                "worst_case": s.worst.case.case_id if s.worst else None,
                "worst_err_over_tol": s.worst.errors.worst_ratio if s.worst and s.worst.errors else None,
            }
            for s in summarize(results)
        ],
    }


# --- the support matrix -------------------------------------------------------------------------

MATRIX_TITLE = "# Support matrix"
MATRIX_PREAMBLE = (
    "Generated by the conformance suite (see docs/conformance.md); do not edit by hand. Each platform's\n"
    "section is rewritten by the command quoted in it; other sections are kept. A value *passes* when\n"
    "every case run with it matched cpu_reference within the tolerance table, *fails* when any case\n"
    "with it failed, and is *unsupported* when the backend does not declare it and refused it with\n"
    "`UnsupportedCase`. Only values the run exercised are listed."
)
_START = "<!-- conformance {key} -->"
_END = "<!-- end conformance {key} -->"
_SECTION_RE = re.compile(
    r"<!-- conformance (?P<key>platform=[\w.\-]+ device=\w+) -->\n.*?<!-- end conformance (?P=key) -->",
    re.DOTALL,
)

_PROPERTIES: list[tuple[str, Callable[[Any], str | None]]] = [  # of an AttentionCase
    ("head size", lambda c: str(c.head_size)),
    ("block size", lambda c: str(c.block_size)),
    ("dtype", lambda c: dtype_name(c.dtype)),
    ("q/kv heads (GQA)", lambda c: f"{c.num_q_heads}/{c.num_kv_heads}"),
    ("sliding window", lambda c: None if c.sliding_window is None else str(c.sliding_window)),
    ("logit softcap", lambda c: None if c.logit_softcap is None else str(c.logit_softcap)),
    ("attention sinks", lambda c: "yes" if c.attention_sinks else None),
]


def _sort_key(value: str) -> tuple[int, float, str]:
    try:
        return (0, float(value.split("/")[0]) * 1000 + float(value.split("/")[-1]), value)
    except ValueError:
        return (1, 0.0, value)


_MOE_PROPERTIES: list[tuple[str, Callable[[Any], str | None]]] = [  # of an MoECase
    ("dtype", lambda c: dtype_name(c.dtype)),
    ("expert weights", lambda c: dtype_name(c.weight_dtype)),
    ("activation", lambda c: c.activation),
    ("scoring", lambda c: c.scoring + (" renormalized" if c.renormalize else "")),
    ("top_k", lambda c: str(c.top_k)),
    ("experts", lambda c: str(c.num_experts)),
    ("tokens", lambda c: str(c.num_tokens)),
]


_INT_LINEAR_PROPERTIES: list[tuple[str, Callable[[Any], str | None]]] = [  # of an IntLinearCase
    ("dtype", lambda c: dtype_name(c.dtype)),
    ("code width", lambda c: f"int{c.bits}"),
    ("group size", lambda c: c.group_label),
    ("zero points", lambda c: "yes" if c.zero_points else "no"),
    ("bias", lambda c: "yes" if c.bias else "no"),
    ("rows", lambda c: str(c.num_tokens)),
    ("in features", lambda c: str(c.in_features)),
    ("out features", lambda c: str(c.out_features)),
]


def _property_rows(
    results: list[CaseResult],
    properties: list[tuple[str, Callable[[Any], str | None]]] = _PROPERTIES,
    case_type: type = AttentionCase,
) -> list[str]:
    rows = ["| property | passes | fails | unsupported |", "|---|---|---|---|"]
    for label, extract in properties:
        status: dict[str, str] = {}  # value -> "fails" | "passes" | "unsupported"
        for r in results:
            if not isinstance(r.case, case_type):
                continue  # engine smoke cases have no kernel properties to list
            value = extract(r.case)
            if value is None:
                continue
            new = {Status.FAILED: "fails", Status.PASSED: "passes", Status.UNSUPPORTED: "unsupported"}[
                r.status
            ]
            old = status.get(value)
            rank = {"fails": 2, "passes": 1, "unsupported": 0}
            if old is None or rank[new] > rank[old]:
                status[value] = new
        cells = [
            ", ".join(sorted((v for v, s in status.items() if s == kind), key=_sort_key)) or "-"
            for kind in ("passes", "fails", "unsupported")
        ]
        if any(cell != "-" for cell in cells):
            rows.append(f"| {label} | {' | '.join(cells)} |")
    return rows


def _group_rows(summaries: list[GroupSummary]) -> list[str]:
    rows = [
        "| case group | passed | failed | unsupported | worst case | max abs err | err/tol |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        worst = _worst_cells(s)
        worst[0] = f"`{worst[0]}`" if worst[0] != "-" else "-"
        rows.append(f"| {s.group} | {s.passed} | {s.failed} | {s.unsupported} | {' | '.join(worst)} |")
    return rows


def _versions() -> str:
    try:
        ours = version("pagedserve")
    except PackageNotFoundError:
        ours = "unknown"
    return f"pagedserve {ours}, torch {torch.__version__.split('+')[0]}"


def matrix_section(info: RunInfo, results: list[CaseResult]) -> str:
    """The markdown section of one platform's run, with its start and end markers. Pure."""
    counts = {status: sum(r.status is status for r in results) for status in Status}
    mode = "quick" if info.quick else "full"
    lines = [
        _START.format(key=info.section_key),
        f"## Platform `{info.platform}` on {info.device}",
        "",
        f"Generated by `{info.command}` ({mode} case set, tensors on {info.device}, {_versions()}): "
        f"{len(results)} cases, {counts[Status.PASSED]} passed, {counts[Status.FAILED]} failed, "
        f"{counts[Status.UNSUPPORTED]} unsupported.",
    ]
    summaries = summarize(results)
    for component in dict.fromkeys(r.component for r in results):
        mine = [r for r in results if r.component == component]
        groups = [s for s in summaries if s.component == component]
        if isinstance(mine[0].case, AttentionCase):
            lines += [
                "",
                f"### Attention backend `{component}`",
                "",
                *_property_rows(mine),
                "",
                *_group_rows(groups),
            ]
        elif isinstance(mine[0].case, MoECase):
            lines += ["", f"### MoE kernel (`{component}`)", "", _moe_declarations(mine), ""]
            lines += [*_property_rows(mine, _MOE_PROPERTIES, MoECase), "", *_group_rows(groups)]
        elif isinstance(mine[0].case, IntLinearCase):
            lines += [
                "",
                f"### Integer-weight linear kernel (`{component}`)",
                "",
                _int_linear_declarations(mine),
                "",
            ]
            lines += [*_property_rows(mine, _INT_LINEAR_PROPERTIES, IntLinearCase), "", *_group_rows(groups)]
        elif isinstance(mine[0].case, LoRACase):
            lines += ["", "### LoRA kernel", "", "Compared with the float64 torch formulation.", ""]
            lines += ["| case | passed | failed | shape |", "|---|---|---|---|"]
            for r in mine:
                passed, failed = int(r.status is Status.PASSED), int(r.status is Status.FAILED)
                lines.append(f"| {r.case.case_id} | {passed} | {failed} | {r.case.description} |")
        else:
            lines += [
                "",
                f"### Cache ops (`{component}`)",
                "",
                "Compared bit for bit with cpu_reference.",
                "",
            ]
            lines += ["| case group | passed | failed | dtypes |", "|---|---|---|---|"]
            for s in groups:
                dtypes = sorted({dtype_name(r.case.dtype) for r in mine if r.group == s.group})
                lines.append(f"| {s.group} | {s.passed} | {s.failed} | {', '.join(dtypes)} |")
    lines.append(_END.format(key=info.section_key))
    return "\n".join(lines)


def _moe_declarations(results: list[CaseResult]) -> str:
    """What the MoE kernel declared, as the cases drawn from it show (`moe_cases` runs the FP8 and
    SwiGLU groups exactly when declared): read back by the support-matrix test. Pure."""
    cases = [r.case for r in results if isinstance(r.case, MoECase)]
    fp8 = sorted({dtype_name(c.weight_dtype) for c in cases if c.fp8_weights})
    activations = sorted({c.activation for c in cases})
    return (
        "Compared with the float64 torch formulation. Declared by the kernel: expert weight dtypes "
        + (", ".join(f"`{d}`" for d in fp8) if fp8 else "none besides the activations'")
        + "; activations "
        + ", ".join(f"`{a}`" for a in activations)
        + "."
    )


def _int_linear_declarations(results: list[CaseResult]) -> str:
    """What the integer-weight linear kernel declared, as the cases drawn from it show
    (`int_linear_cases` draws exactly the widths and group sizes the kernel takes). Pure."""
    cases = [r.case for r in results if isinstance(r.case, IntLinearCase)]
    widths = sorted({c.bits for c in cases})
    sizes = sorted({c.group_label for c in cases}, key=_sort_key)
    return (
        "Compared with the float64 dequantize-then-multiply formulation. Declared by the kernel "
        "(the cases drawn from it): code widths "
        + ", ".join(f"`int{b}`" for b in widths)
        + "; group sizes "
        + ", ".join(f"`{s}`" for s in sizes)
        + "."
    )


def update_support_matrix(path: Path, info: RunInfo, results: list[CaseResult]) -> None:
    """Write this run's section into the markdown file at `path`, replacing the previous section of
    the same platform and device type and keeping the others (sorted). Creates the file if needed. Mutates
    the file."""
    sections: dict[str, str] = {}
    if path.exists():
        for m in _SECTION_RE.finditer(path.read_text()):
            sections[m["key"]] = m.group(0)
    sections[info.section_key] = matrix_section(info, results)
    body = "\n\n".join(sections[name] for name in sorted(sections))
    path.write_text(f"{MATRIX_TITLE}\n\n{MATRIX_PREAMBLE}\n\n{body}\n")
