"""The conformance suite as a pytest plugin: one test per (component, case) of a platform.

    pytest -p pagedserve.conformance.pytest_plugin --pagedserve-platform NAME [--pagedserve-quick] \
        [--pagedserve-allow-unavailable] --pyargs pagedserve.conformance.test_platform

The items and checks are `ConformanceSuite`'s, exactly as `pagedserve conformance` runs them. A case
the backend does not declare is reported as *skipped* with the reason "unsupported: ...", after the
suite checked that calling it raised `UnsupportedCase`; a failure lists every check that failed.
"""

from __future__ import annotations

import pytest

from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite, SuiteItem
from pagedserve.platforms.errors import PlatformError

ITEM_FIXTURE = "pagedserve_conformance_item"
_SUITE = pytest.StashKey[ConformanceSuite]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pagedserve conformance")
    group.addoption(
        "--pagedserve-platform", metavar="NAME", help="platform whose backends and cache ops to check"
    )
    group.addoption("--pagedserve-quick", action="store_true", help="the small case set (CI, interpreters)")
    group.addoption(
        "--pagedserve-allow-unavailable",
        action="store_true",
        help="CPU test mode: run an unavailable platform's backends on CPU tensors (e.g. TRITON_INTERPRET=1)",
    )
    group.addoption("--pagedserve-seed", type=int, default=0, help="base seed of every case's inputs")


def conformance_suite(config: pytest.Config) -> ConformanceSuite:
    """The suite of this pytest run, built on first use from the command-line options. Raises
    `pytest.UsageError` when no platform is named or it cannot be used."""
    suite = config.stash.get(_SUITE, None)
    if suite is None:
        name = config.getoption("pagedserve_platform")
        if not name:
            raise pytest.UsageError("the conformance suite needs --pagedserve-platform NAME")
        try:
            suite = ConformanceSuite.for_platform(
                name,
                quick=bool(config.getoption("pagedserve_quick")),
                allow_unavailable=bool(config.getoption("pagedserve_allow_unavailable")),
                seed=int(config.getoption("pagedserve_seed")),
            )
        except PlatformError as e:
            raise pytest.UsageError(str(e)) from e
        config.stash[_SUITE] = suite
    return suite


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize every test asking for `pagedserve_conformance_item` over the suite's items."""
    if ITEM_FIXTURE in metafunc.fixturenames:
        items = conformance_suite(metafunc.config).items()
        metafunc.parametrize(ITEM_FIXTURE, items, ids=[item.item_id for item in items])


@pytest.fixture
def pagedserve_conformance_suite(request: pytest.FixtureRequest) -> ConformanceSuite:
    return conformance_suite(request.config)


def check_item(suite: ConformanceSuite, item: SuiteItem) -> None:
    """Run one item: pass, fail with every problem, or skip as unsupported."""
    result = suite.run_item(item)
    if result.status is Status.UNSUPPORTED:
        pytest.skip(result.note)
    if result.status is Status.FAILED:
        pytest.fail(result.summary(), pytrace=False)
