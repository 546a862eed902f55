"""docs/support_matrix.md is generated: its cpu_reference section must be what a run of the current
suite produces (statuses and counts; error values depend on the machine's float kernels and are
not compared). Regenerate with the command quoted in the section when this fails."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from pagedserve.conformance.cases import attention_cases, cache_op_cases, engine_cases
from pagedserve.conformance.report import RunInfo, matrix_section
from pagedserve.conformance.suite import ConformanceSuite

MATRIX = Path(__file__).resolve().parents[1] / "docs" / "support_matrix.md"
KEY = "platform=cpu_reference device=cpu"
SECTION = re.compile(f"<!-- conformance {KEY} -->.*?<!-- end conformance {KEY} -->", re.S)


def _tables(section: str) -> list[str]:
    """Table rows without the worst-case columns (id, max abs err, err/tol)."""
    rows = []
    for line in section.splitlines():
        if not line.startswith("| "):
            continue
        cells = line.strip("|").split("|")
        if len(cells) == 7:  # the per-group table
            cells = cells[:4]
        rows.append("|".join(c.strip() for c in cells))
    return rows


@pytest.mark.slow
def test_cpu_reference_section_matches_a_fresh_run() -> None:
    found = SECTION.search(MATRIX.read_text())
    assert found, "docs/support_matrix.md has no cpu_reference section; generate it (docs/conformance.md)"
    suite = ConformanceSuite.for_platform("cpu_reference", quick=False)
    info = RunInfo("cpu_reference", "cpu", "cpu", False, "(fresh run)")
    fresh = matrix_section(info, suite.run())
    assert _tables(found.group(0)) == _tables(fresh), (
        "docs/support_matrix.md is stale: run `pagedserve conformance --platform cpu_reference "
        "--support-matrix docs/support_matrix.md`"
    )


_ANY_SECTION = re.compile(
    r"<!-- conformance platform=(?P<platform>[\w.\-]+) device=\w+ -->\n(?P<body>.*?)<!-- end conformance",
    re.S,
)


def _group_totals(body: str) -> Counter[tuple[str, str]]:
    """(component, case group) -> cases the section reports in that group (passed + failed +
    unsupported), read from the per-group tables of its attention backends and cache ops (the
    LoRA and MoE kernels' tables are left out: their cases are not the attention matrix's)."""
    totals: Counter[tuple[str, str]] = Counter()
    component: str | None = None
    for line in body.splitlines():
        if line.startswith("### "):
            heading = re.match(r"### (?:Attention backend |Cache ops \()`([^`]+)`", line)
            component = heading.group(1) if heading else None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if component is not None and line.startswith("| ") and len(cells) >= 4 and cells[1].isdigit():
            counts = cells[1:4] if len(cells) == 7 else cells[1:3]  # cache-op rows have no unsupported
            totals[(component, cells[0])] += sum(int(c) for c in counts)
    return totals


def test_triton_sections_cover_the_current_case_matrix() -> None:
    """The triton sections (CPU test mode and GPU) come from runs too slow to repeat here, so only
    their case counts are checked: the CPU test mode's reports exactly the cases the current matrix
    has for what the triton platform declares; a GPU run's section, which only a GPU host can
    regenerate, reports no case the matrix no longer has (groups added since it ran are absent
    until the next GPU run). Builds the matrix from the declarations, runs nothing (and imports no
    kernel, which would fix triton's interpreter choice for this process)."""
    import pagedserve_triton.plugin as triton_plugin
    from pagedserve_triton.capabilities import UNIFIED_ATTENTION_CAPABILITIES as caps

    (info,) = triton_plugin.pagedserve_platforms()
    sections = [m for m in _ANY_SECTION.finditer(MATRIX.read_text()) if m.group("platform") == "triton"]
    assert sections, "docs/support_matrix.md has no triton section"
    for section in sections:
        body = section.group("body")
        quick = "(quick case set" in body
        reported = _group_totals(body)
        backends = {component for component, _ in reported} - {"cache_ops"}
        assert len(backends) == 1, f"one attention backend expected in the triton section, got {backends}"
        (backend,) = backends
        expected: Counter[tuple[str, str]] = Counter(
            (backend, c.group) for c in attention_cases(caps, quick=quick)
        )
        expected.update((backend, c.group) for c in engine_cases(backend, caps, info.supported_dtypes))
        expected.update(
            ("cache_ops", c.group)
            for c in cache_op_cases(
                info.supported_dtypes, caps.block_sizes, quick=quick, kv_cache_dtypes=caps.kv_cache_dtypes
            )
        )
        if "(CPU test mode)" not in body:
            stale = {key: n for key, n in reported.items() if n > expected.get(key, 0)}
            assert not stale, f"the triton GPU section reports cases the matrix no longer has: {stale}"
            continue
        assert reported == expected, (
            f"the triton section generated by {body.splitlines()[2][:120]!r} no longer matches the case "
            "matrix: regenerate it with the command it quotes"
        )
