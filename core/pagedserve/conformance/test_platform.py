"""The conformance test module the pytest plugin parametrizes (see `pytest_plugin`); run it with
`--pyargs pagedserve.conformance.test_platform` and `-p pagedserve.conformance.pytest_plugin`."""

from __future__ import annotations

from pagedserve.conformance.pytest_plugin import check_item
from pagedserve.conformance.suite import ConformanceSuite, SuiteItem


def test_conformance(
    pagedserve_conformance_suite: ConformanceSuite, pagedserve_conformance_item: SuiteItem
) -> None:
    check_item(pagedserve_conformance_suite, pagedserve_conformance_item)
