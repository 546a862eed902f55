"""`pagedserve platforms`: every discovered platform, its backends and capabilities, and the
plugins that failed to load. `--json` prints the same as one JSON object."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.registry import LoadedPlatform, PlatformRegistry, load_platforms


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "platforms", help="list platform plugins, their attention backends and load errors"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """Print the report; exit status 0 (a broken plugin is part of the report, not a failure)."""
    report = describe(load_platforms())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_text(report))
    return 0


def _dtype_names(dtypes: frozenset[torch.dtype] | tuple[torch.dtype, ...]) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in dtypes)


def _describe_backend(backend: type[AttentionBackend]) -> dict[str, Any]:
    caps: AttentionCapabilities = backend.capabilities
    features = [
        f for f, on in (("sliding_window", caps.sliding_window), ("logit_softcap", caps.logit_softcap)) if on
    ]
    return {
        "name": backend.name,
        "class": f"{backend.__module__}.{backend.__qualname__}",
        "head_sizes": sorted(caps.head_sizes),
        "dtypes": _dtype_names(caps.dtypes),
        "block_sizes": sorted(caps.block_sizes),
        "kv_cache_layout": caps.kv_cache_layout.value,
        "features": features,
        "max_query_len": caps.max_query_len,
    }


def _describe_platform(platform: LoadedPlatform) -> dict[str, Any]:
    info = platform.info
    entry: dict[str, Any] = {
        "name": info.name,
        "plugin": platform.plugin_name,
        "plugin_version": platform.plugin_version,
        "api_version": platform.api_version,
        "priority": info.priority,
        "device_type": info.device_type,
        "available": platform.availability.available,
        "availability_reason": platform.availability.reason,
        "dtypes": _dtype_names(info.supported_dtypes),
        "description": info.description,
    }
    # A platform whose hooks fail is still listed, with the error where the answer would be.
    try:
        entry["attention_backends"] = [_describe_backend(b) for b in platform.attention_backends()]
    except PlatformError as e:
        entry["attention_backends"] = []
        entry["attention_backends_error"] = str(e)
    try:
        ops = platform.cache_ops()
        entry["cache_ops"] = f"{type(ops).__module__}.{type(ops).__qualname__}"
    except PlatformError as e:
        entry["cache_ops"] = None
        entry["cache_ops_error"] = str(e)
    return entry


def describe(registry: PlatformRegistry) -> dict[str, Any]:
    """The report as plain data (what `--json` prints). Asks every platform for its availability,
    backends and cache ops."""
    platforms = [_describe_platform(p) for p in registry.platforms()]
    # Read errors after describing: hook failures while describing are reported too.
    errors = [
        {"plugin": e.plugin_name, "distribution": e.distribution, "error": e.error}
        for e in registry.load_errors
    ]
    return {"platforms": platforms, "load_errors": errors}


def _ranges(values: list[int]) -> str:
    """Sorted ints with runs of three or more consecutive values collapsed: [1, 2, 3, 5] -> "1-3, 5"."""
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{values[i]}-{values[j]}")
        else:
            parts.extend(str(v) for v in values[i : j + 1])
        i = j + 1
    return ", ".join(parts)


def format_text(report: dict[str, Any]) -> str:
    """The report for people: one block per platform, then the load errors."""
    lines: list[str] = []
    if not report["platforms"]:
        lines.append("No platforms found (no plugin in entry-point group 'pagedserve.platforms' loaded).")
    for p in report["platforms"]:
        status = "available" if p["available"] else "NOT available"
        lines += [
            f"{p['name']}  [{status}: {p['availability_reason']}]",
            f"  plugin: {p['plugin']} {p['plugin_version']} (plugin API {p['api_version']})",
            f"  priority: {p['priority']}   device: {p['device_type']}   dtypes: {', '.join(p['dtypes'])}",
        ]
        if p["description"]:
            lines.append(f"  description: {p['description']}")
        lines.append(f"  cache ops: {p['cache_ops'] or 'ERROR: ' + p['cache_ops_error']}")
        if "attention_backends_error" in p:
            lines.append(f"  attention backends: ERROR: {p['attention_backends_error']}")
        for b in p["attention_backends"]:
            lines += [
                f"  attention backend {b['name']} ({b['class']})",
                f"    head sizes: {_ranges(b['head_sizes'])}",
                f"    dtypes: {', '.join(b['dtypes'])}   block sizes: {_ranges(b['block_sizes'])}",
                f"    layout: {b['kv_cache_layout']}   features: {', '.join(b['features']) or 'none'}"
                f"   max query len: {b['max_query_len'] if b['max_query_len'] is not None else 'any'}",
            ]
        lines.append("")
    if report["load_errors"]:
        lines.append("Plugin errors:")
        for e in report["load_errors"]:
            origin = f" (distribution {e['distribution']})" if e["distribution"] else ""
            lines.append(f"  {e['plugin']}{origin}: {e['error']}")
    return "\n".join(lines).rstrip()
