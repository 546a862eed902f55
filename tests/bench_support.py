"""The benchmark scripts, loaded in tests. `benchmarks/` holds scripts run from their own folder,
which import their neighbours by file name, so each is loaded from its file rather than imported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str, folder: str = "") -> ModuleType:
    """`benchmarks/[folder/]name.py` as the module `bench_<name>`, registered in `sys.modules`
    (dataclasses resolve annotations through it), with its folder on `sys.path` so that its own
    imports of neighbouring scripts work as when it runs from there. Runs the file on every call."""
    directory = ROOT / "benchmarks" / folder
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[f"bench_{name}"] = module
    spec.loader.exec_module(module)
    return module
