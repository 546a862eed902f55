"""Print pagedserve's requirements for a GPU host, torch left out, one per line, for `pip download`.

A GPU host keeps the torch build that matches its driver, so the wheels to bring to a host without
internet are everything else the project needs (docs/gpu_hosts.md):

    python benchmarks/gpu_requirements.py cuda > gpu-requirements.txt

The list is read from pyproject.toml, so it never drifts from what `pip install -e ".[cuda]"`
asks for.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The build backend: `pip install --no-index` builds the editable install from local wheels too.
BUILD_REQUIREMENT = "setuptools>=70"


def requirements(pyproject: dict[str, object], extras: list[str]) -> list[str]:
    """The dependencies plus those of `extras` (following `pagedserve[...]` self-references),
    without torch, in first-seen order. Raises ValueError for an extra that does not exist. Pure."""
    project = pyproject["project"]
    assert isinstance(project, dict)
    optional: dict[str, list[str]] = project.get("optional-dependencies", {})
    name = project["name"]
    out: list[str] = []
    pending = list(extras)
    seen_extras: set[str] = set()
    for req in project.get("dependencies", []):
        _add(out, req)
    while pending:
        extra = pending.pop(0)
        if extra in seen_extras:
            continue
        if extra not in optional:
            raise ValueError(f"pyproject.toml has no extra {extra!r}; extras: {', '.join(sorted(optional))}")
        seen_extras.add(extra)
        for req in optional[extra]:
            self_ref = re.fullmatch(rf"{re.escape(name)}\[([^\]]+)\]", req.strip())
            if self_ref:
                pending.extend(e.strip() for e in self_ref.group(1).split(","))
            else:
                _add(out, req)
    return out


def _add(out: list[str], req: str) -> None:
    dist = re.split(r"[<>=!~;\[ ]", req.strip(), maxsplit=1)[0].lower()
    if dist != "torch" and req not in out:
        out.append(req)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("extras", nargs="*", default=["cuda"], help="extras to include (default: cuda)")
    args = parser.parse_args(argv)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    try:
        lines = requirements(pyproject, args.extras)
    except ValueError as exc:
        parser.error(str(exc))
    print("\n".join([*lines, BUILD_REQUIREMENT]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
