"""The cross-backend conformance suite: every attention backend and the cache ops of a platform,
checked against cpu_reference in float64 over one case matrix (see docs/conformance.md).

Entry points: `pagedserve conformance --platform NAME [--quick]` and the pytest plugin
`pagedserve.conformance.pytest_plugin`; both run `ConformanceSuite`'s items.
"""
