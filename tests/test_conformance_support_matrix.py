"""docs/support_matrix.md is generated: its cpu_reference section must be what a run of the current
suite produces (statuses and counts; error values depend on the machine's float kernels and are
not compared). Regenerate with the command quoted in the section when this fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
