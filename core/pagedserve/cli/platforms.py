"""`pagedserve platforms`: every discovered platform, its backends and capabilities, and the
plugins that failed to load. `--json` prints the same as one JSON object.

`pagedserve platforms --explain --batch 64x1x2048 --heads 32/8 --head-size 128 --dtype bfloat16`
says which kernel each backend that can explain itself (`ExplainsBatches`) runs for that batch and
why. The device is this machine's GPU when the platform is available, else `--device`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import torch

from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.registry import LoadedPlatform, PlatformRegistry, load_platforms


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "platforms", help="list platform plugins, their attention backends and load errors"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    explain = parser.add_argument_group("kernel choice (--explain)")
    explain.add_argument(
        "--explain", action="store_true", help="say which attention kernel a batch gets, and why"
    )
    explain.add_argument("--platform", help="explain only this platform (default: every one that can)")
    explain.add_argument(
        "--batch",
        default="64x1x2048",
        metavar="SEQSxQUERYxCTX",
        help="sequences x longest query (1 = decode) x longest context, e.g. 64x1x2048 (default)",
    )
    explain.add_argument("--heads", default="32/8", metavar="Q/KV", help="query/KV heads (default 32/8)")
    explain.add_argument("--head-size", type=int, default=128, help="default 128")
    explain.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES), help="default bfloat16")
    explain.add_argument("--block-size", type=int, default=16, help="KV-cache block size (default 16)")
    explain.add_argument("--sliding-window", type=int, help="attention window in tokens (default: none)")
    explain.add_argument("--softcap", type=float, help="logit softcap (default: none)")
    explain.add_argument(
        "--device",
        metavar="NAME:SMS:MAJOR.MINOR",
        help=f"GPU to assume where the platform has none here (default: '{_ASSUMED_DEVICE}')",
    )
    explain.add_argument(
        "--arch",
        metavar="GFX",
        help="AMD GPU architecture to assume for AMD platforms (rocm), e.g. gfx942 or gfx950; without an "
        "AMD --device, the architecture's largest part",
    )
    parser.set_defaults(handler=run)


_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
_ASSUMED_DEVICE = "NVIDIA H100 80GB HBM3:132:9.0"


@dataclass(frozen=True, slots=True)
class BatchQuery:
    """One attention call's geometry and the GPU it runs on, as `--explain` describes it."""

    num_seqs: int
    max_query_len: int  # 1: every sequence decodes one token
    max_seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None
    logit_softcap: float | None
    device_name: str
    num_sms: int
    capability: tuple[int, int]
    arch: str | None = None  # AMD architecture ("gfx942"): the device's, or --arch; None elsewhere


@runtime_checkable
class ExplainsBatches(Protocol):
    """An attention backend that can say which kernel it runs for a batch (optional; a backend
    without `explain_batch` is listed as not explaining itself)."""

    def explain_batch(self, batch: BatchQuery) -> str:
        """One line: the kernel and the reason. Host-only, no device access."""
        ...


def _parse_device(text: str) -> tuple[str, int, tuple[int, int]]:
    match = re.fullmatch(r"(.+):(\d+):(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"--device {text!r} must be NAME:SMS:MAJOR.MINOR, e.g. {_ASSUMED_DEVICE!r}")
    return match[1], int(match[2]), (int(match[3]), int(match[4]))


def batch_query(
    args: argparse.Namespace, device: tuple[str, int, tuple[int, int]], arch: str | None = None
) -> BatchQuery:
    """The `--explain` flags as a `BatchQuery` on `device`; `ValueError` names a malformed flag."""
    batch = re.fullmatch(r"(\d+)x(\d+)x(\d+)", args.batch)
    if batch is None:
        raise ValueError(f"--batch {args.batch!r} must be SEQSxQUERYxCTX, e.g. 64x1x2048")
    heads = re.fullmatch(r"(\d+)/(\d+)", args.heads)
    if heads is None:
        raise ValueError(f"--heads {args.heads!r} must be Q/KV, e.g. 32/8")
    num_seqs, query_len, ctx = (int(g) for g in batch.groups())
    if num_seqs < 1 or not 1 <= query_len <= ctx:
        raise ValueError(f"--batch {args.batch!r} needs >= 1 sequence and 1 <= query <= context")
    return BatchQuery(
        num_seqs=num_seqs,
        max_query_len=query_len,
        max_seq_len=ctx,
        num_q_heads=int(heads[1]),
        num_kv_heads=int(heads[2]),
        head_size=args.head_size,
        dtype=_DTYPES[args.dtype],
        block_size=args.block_size,
        sliding_window=args.sliding_window,
        logit_softcap=args.softcap,
        device_name=device[0],
        num_sms=device[1],
        capability=device[2],
        arch=arch,
    )


def explain_text(registry: PlatformRegistry, args: argparse.Namespace) -> str:
    """The `--explain` report: one line per explaining backend. Raises `ValueError` for bad flags
    and `PlatformError` for an unknown `--platform`."""
    assumed = _parse_device(args.device or _ASSUMED_DEVICE)
    batch_query(args, assumed)  # malformed flags fail before any platform is asked
    platforms = [registry.get(args.platform)] if args.platform else registry.platforms()
    lines = [f"batch: {query_desc(args)}"]
    silent: list[str] = []
    explained = 0
    absent = _absent_gpu_note(platforms)
    # Asked for nothing in particular on a host without a GPU, the GPU platforms are left out:
    # describing an assumed H100 or MI300X would read as if this machine had one. Naming the
    # platform, --device or --arch asks for that description, so it is still given.
    skip_gpu_platforms = absent is not None and not (args.platform or args.device or args.arch)
    if absent is not None:
        hint = (
            "pass --device NAME:SMS:MAJOR.MINOR (or --arch GFX for rocm) to see what they would run there"
            if skip_gpu_platforms
            else "what follows is for an assumed GPU"
        )
        lines.append(f"{absent}; {hint}")
    for platform in platforms:
        if skip_gpu_platforms and platform.info.device_type == "cuda":
            continue
        device, where = assumed, "assumed (--device)" if args.device else "assumed: no GPU of it here"
        arch: str | None = args.arch
        if platform.availability.available and platform.info.device_type == "cuda":
            props = torch.cuda.get_device_properties(0)
            device, where = (props.name, props.multi_processor_count, (props.major, props.minor)), "this GPU"
            if torch.version.hip is not None:
                arch = getattr(props, "gcnArchName", "unknown").split(":")[0]
        try:
            backends = platform.attention_backends()
        except PlatformError as e:
            lines.append(f"{platform.name}: {e}")
            continue
        for backend_cls in backends:
            backend = backend_cls()
            if not isinstance(backend, ExplainsBatches):
                silent.append(f"{platform.name}/{backend_cls.name}")
                continue
            name, sms, (major, minor) = device
            if arch is not None and where != "this GPU":
                # The backend names the AMD part it assumes for the architecture.
                header = f"{arch} ({'--arch' if args.arch else where})"
            elif arch is not None:
                header = f"{name} ({sms} CUs, {arch}; {where})"
            else:
                header = f"{name} ({sms} SMs, sm_{major}{minor}; {where})"
            lines.append(f"{platform.name}/{backend_cls.name} on {header}:")
            lines.append(f"  {backend.explain_batch(batch_query(args, device, arch))}")
            explained += 1
    if explained == 0:
        if args.platform:
            scope = f"platform {args.platform!r}"
        else:
            scope = "the platforms available here" if skip_gpu_platforms else "any platform"
        lines.append(f"no backend of {scope} explains its kernel choice")
    if silent:
        lines.append(f"(backends that do not explain their choice: {', '.join(silent)})")
    return "\n".join(lines)


def _absent_gpu_note(platforms: list[LoadedPlatform]) -> str | None:
    """A "no GPU found: ..." line with each GPU platform's own reason for being unavailable, when this
    host has no GPU that torch sees and none of `platforms` that runs on one is available; None
    otherwise (a GPU is here, or no GPU platform was asked about)."""
    gpu_platforms = [p for p in platforms if p.info.device_type == "cuda"]
    if not gpu_platforms or torch.cuda.device_count() > 0:
        return None
    if any(p.availability.available for p in gpu_platforms):
        return None
    names = ", ".join(p.name for p in gpu_platforms)
    reasons = "; ".join(f"{p.name}: {p.availability.reason}" for p in gpu_platforms)
    verb = "is" if len(gpu_platforms) == 1 else "are"
    return f"no GPU found: {names} {verb} unavailable here because {reasons}"


def query_desc(args: argparse.Namespace) -> str:
    """The batch flags for people. Pure."""
    seqs, query_len, ctx = args.batch.split("x")
    kind = "decode" if query_len == "1" else f"up to {query_len} query tokens per sequence"
    extras = "".join(
        f", {name} {value}"
        for name, value in (("window", args.sliding_window), ("softcap", args.softcap))
        if value
    )
    return (
        f"{seqs} sequences ({kind}), longest context {ctx}, heads {args.heads}, head size {args.head_size}, "
        f"{args.dtype}, block size {args.block_size}{extras}"
    )


def run(args: argparse.Namespace) -> int:
    """Print the report; exit status 0 (a broken plugin is part of the report, not a failure).
    With --explain, the kernel choice instead; exit status 2 for malformed flags."""
    if args.explain:
        try:
            print(explain_text(load_platforms(), args))
        except (ValueError, PlatformError) as e:
            print(f"pagedserve platforms --explain: {e}", file=sys.stderr)
            return 2
        return 0
    report = describe(load_platforms())
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_text(report))
    return 0


def _dtype_names(dtypes: frozenset[torch.dtype] | tuple[torch.dtype, ...]) -> list[str]:
    return sorted(str(d).removeprefix("torch.") for d in dtypes)


# Labels for the text report. The report walks the fields of the backend's capabilities, so a field
# missing here (one a newer plugin API added) is still shown, under its own name. Flags (bool
# fields) are shown by their field names, the names a plugin writes in its `AttentionCapabilities`.
_CAPABILITY_LABELS = {
    "head_sizes": "head sizes",
    "block_sizes": "block sizes",
    "kv_cache_layout": "layout",
    "max_query_len": "max query len",
    "kv_cache_dtypes": "quantized KV caches",
}
# What None means for an optional field in the text report (a limit: "any"); "none" otherwise.
_NONE_TEXT = {"max_query_len": "any"}


def _capability_json(value: object) -> Any:
    """A capability value as JSON data: sets as sorted lists (dtypes by name), enums by value."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, frozenset | set | tuple | list):
        if all(isinstance(v, torch.dtype) for v in value):
            return _dtype_names(tuple(value))
        return sorted(_capability_json(v) for v in value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


# The keys of a `_describe_backend` entry that are not capability fields.
_BACKEND_KEYS = ("name", "class", "features")


def _describe_backend(backend: type[AttentionBackend]) -> dict[str, Any]:
    """Name, class and every field of the backend's capabilities under the field's name, plus
    `features`: the names of the flags it declares (the fields are read from the instance, so a
    field a newer plugin API adds is reported without a change here)."""
    caps: AttentionCapabilities = backend.capabilities
    values = {f.name: getattr(caps, f.name) for f in fields(caps)}
    return {
        "name": backend.name,
        "class": f"{backend.__module__}.{backend.__qualname__}",
        **{name: _capability_json(value) for name, value in values.items()},
        "features": [name for name, value in values.items() if value is True],
    }


def _capability_lines(backend: dict[str, Any], names: list[str]) -> list[str]:
    """The text report's lines for the capability fields `names` of one `_describe_backend` entry:
    each set on its own line, the single values on one line, then the flags, declared ones first."""
    sets: list[str] = []
    values: list[str] = []
    on: list[str] = []
    off: list[str] = []
    for name in names:
        value = backend[name]
        label = _CAPABILITY_LABELS.get(name, name.replace("_", " "))
        if isinstance(value, bool):
            (on if value else off).append(name)
        elif isinstance(value, list):
            shown = _ranges(value) if all(type(v) is int for v in value) else ", ".join(map(str, value))
            sets.append(f"{label}: {shown or 'none'}")
        else:
            values.append(f"{label}: {_NONE_TEXT.get(name, 'none') if value is None else value}")
    flags = f"features: {', '.join(on) or 'none'}"
    if off:
        flags += f" (not declared: {', '.join(off)})"
    return [*sets, *(["   ".join(values)] if values else []), flags]


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
            lines.append(f"  attention backend {b['name']} ({b['class']})")
            names = [k for k in b if k not in _BACKEND_KEYS]
            lines += [f"    {line}" for line in _capability_lines(b, names)]
        lines.append("")
    if report["load_errors"]:
        lines.append("Plugin errors:")
        for e in report["load_errors"]:
            origin = f" (distribution {e['distribution']})" if e["distribution"] else ""
            lines.append(f"  {e['plugin']}{origin}: {e['error']}")
    return "\n".join(lines).rstrip()
