"""`pagedserve conformance --platform NAME`: run the conformance suite of one platform against
cpu_reference and print one table per backend; exit status 1 if any case failed.

The same items and checks as the pytest plugin (`pagedserve.conformance.pytest_plugin`); see
docs/conformance.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

EXIT_FAILED = 1
EXIT_UNUSABLE = 2  # unknown or unavailable platform, or no oracle: nothing was checked


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="check a platform's attention backends, cache ops and LoRA, MoE and integer-weight "
        "linear kernels against cpu_reference",
        description="Run every attention backend, the cache ops and the LoRA, MoE and integer-weight "
        "linear kernels of a platform against the float64 cpu_reference over the conformance case "
        "matrix. Exits 1 if any case fails.",
    )
    parser.add_argument("--platform", required=True, help="platform name (see `pagedserve platforms`)")
    parser.add_argument("--quick", action="store_true", help="the small case set (CI, Triton interpreter)")
    parser.add_argument(
        "--allow-unavailable",
        action="store_true",
        help="CPU test mode: run the backends of an unavailable platform on CPU tensors "
        "(e.g. Triton kernels with TRITON_INTERPRET=1 set)",
    )
    parser.add_argument(
        "--support-matrix",
        type=Path,
        metavar="PATH",
        help="write this platform's section of the markdown support matrix into PATH",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--seed", type=int, default=0, help="base seed of every case's inputs (default 0)")
    parser.set_defaults(handler=run)


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, for the support matrix's header."""
    parts = ["pagedserve conformance", f"--platform {args.platform}"]
    if args.quick:
        parts.append("--quick")
    if args.allow_unavailable:
        parts.append("--allow-unavailable")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    if args.support_matrix is not None:
        parts.append(f"--support-matrix {args.support_matrix}")
    # The Triton interpreter changes what runs; name it so the command really reproduces the run.
    prefix = "TRITON_INTERPRET=1 " if os.environ.get("TRITON_INTERPRET") == "1" else ""
    return prefix + " ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Run the suite; print the report (text or JSON) and optionally write the support matrix."""
    from pagedserve.conformance.report import RunInfo, format_text, to_json, update_support_matrix
    from pagedserve.conformance.results import Status
    from pagedserve.conformance.suite import ConformanceSuite
    from pagedserve.platforms.errors import PlatformError

    try:
        suite = ConformanceSuite.for_platform(
            args.platform, quick=args.quick, allow_unavailable=args.allow_unavailable, seed=args.seed
        )
        items = suite.items()
    except PlatformError as e:
        print(f"pagedserve conformance: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    print(
        f"running {len(items)} conformance cases of platform {args.platform!r} on {suite.describe_device()}",
        file=sys.stderr,
    )
    start = time.monotonic()
    results = []
    for item in items:
        results.append(suite.run_item(item))
        logger.debug("%s", results[-1].summary())  # `pagedserve -v conformance ...` shows progress
    elapsed = time.monotonic() - start
    device = suite.describe_device()
    info = RunInfo(args.platform, suite.device.type, device, args.quick, _command(args))
    if args.json:
        print(json.dumps({**to_json(info, results), "seconds": round(elapsed, 1)}, indent=2))
    else:
        print(format_text(info, results))
        print(f"took {elapsed:.1f} s")
    if args.support_matrix is not None:
        update_support_matrix(args.support_matrix, info, results)
        print(
            f"support matrix section for {args.platform!r} written to {args.support_matrix}", file=sys.stderr
        )
    return EXIT_FAILED if any(r.status is Status.FAILED for r in results) else 0
