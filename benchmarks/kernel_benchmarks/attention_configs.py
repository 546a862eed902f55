"""Tuned-config files for the attention benchmarks: the shipped files of the Triton plugin with
one kernel's entries swapped for a point of a sweep (`--tune`, and the decode sweeps of the other
kernel scripts) or overlaid by entries for this device (`--variants`), and the variants' winners
written back into files of the shipped form.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attention_batches import Shape

from pagedserve.platforms.tuned_configs import ShapeValue, TunedConfigFile, TunedConfigNotFound, TunedConfigs
from pagedserve_triton.launch_params import CONFIG_DIR


def config_file_content(kernel: str, device: str, entries: list[dict[str, object]]) -> dict[str, object]:
    """A tuned-config file's JSON content: `entries` for `kernel` on `device` (a device name, a
    family or "default"). Raises pydantic's ValidationError for content the loader would refuse."""
    content = {"schema_version": 1, "kernel": kernel, "device": device, "configs": entries}
    TunedConfigFile.model_validate(content)  # never write a file the loader would refuse
    return content


def shipped_files(but_kernel: str | None = None) -> list[tuple[Path, TunedConfigFile]]:
    """The Triton plugin's shipped tuned-config files, less those of `but_kernel`. Reads them."""
    paths = sorted(CONFIG_DIR.glob("*.json"))
    if but_kernel is not None:
        paths = [p for p in paths if not p.name.startswith(but_kernel + "-")]
    return [(p, TunedConfigFile.model_validate_json(p.read_text())) for p in paths]


def configs_with_point(kernel: str, params: dict[str, Any]) -> TunedConfigs:
    """The shipped tuned configs, except that `kernel` gets only `params`: one point of a sweep,
    the other kernels on their shipped configs."""
    content = config_file_content(kernel, "default", [{"params": params}])
    files = [(Path(f"<sweep {kernel}>"), TunedConfigFile.model_validate(content))]
    return TunedConfigs(files + shipped_files(but_kernel=kernel))


def configs_with(device_name: str, overrides: dict[str, list[dict[str, object]]]) -> TunedConfigs:
    """The shipped tuned configs plus, per kernel in `overrides`, a file of those entries keyed to
    the exact `device_name`, which the lookup searches before the family and default files (a
    shape no override entry matches falls through to the shipped files). Reads the shipped files."""
    files = shipped_files()
    for kernel, entries in overrides.items():
        content = config_file_content(kernel, device_name, entries)
        files.append((Path(f"<override {kernel}>"), TunedConfigFile.model_validate(content)))
    return TunedConfigs(files)


def shipped_params(kernel: str, device_name: str, shape: Shape, max_query_len: int) -> dict[str, bool | int]:
    """The shipped config params of `kernel` for this shape class (as the backend looks it up)."""
    params = TunedConfigs(shipped_files()).lookup(kernel, device_name, **shape_keys(shape, max_query_len))
    return {k: v for k, v in params.items() if isinstance(v, bool | int)}


def replace_entry_params(
    content: dict[str, Any],
    device_name: str,
    shape_keys: dict[str, ShapeValue],
    params: dict[str, bool | int],
) -> int:
    """In a tuned-config file's `content`, replace the params of the first entry that matches
    `shape_keys` (the entry the lookup picks for that class) and return its index. Mutates
    `content`. Raises `TunedConfigNotFound` when no entry matches."""
    file = TunedConfigFile.model_validate(content)
    for index, entry in enumerate(file.configs):
        one = TunedConfigFile(schema_version=1, kernel=file.kernel, device=file.device, configs=[entry])
        try:
            TunedConfigs([(Path("<entry>"), one)]).lookup(file.kernel, device_name, **shape_keys)
        except TunedConfigNotFound:
            continue
        content["configs"][index]["params"] = dict(params)
        TunedConfigFile.model_validate(content)
        return index
    raise TunedConfigNotFound(f"no entry of {file.kernel}-{file.device} matches {shape_keys}")


def shape_keys(shape: Shape, max_query_len: int) -> dict[str, ShapeValue]:
    """The lookup keys of `shape`'s class at `max_query_len`, bucketed to a power of two as the
    backend buckets it. Pure."""
    return {
        "head_size": shape.head_size,
        "block_size": shape.block_size,
        "num_queries_per_kv": shape.q_heads // shape.kv_heads,
        "dtype": str(shape.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(shape.dtype).removeprefix("torch."),  # the variants' cache: the model's dtype
        "max_query_len": 1 << (max(max_query_len, 1) - 1).bit_length(),
    }


def write_variant_configs(
    out_dir: Path,
    family: str,
    device_name: str,
    shape: Shape,
    prefill: tuple[dict[str, bool | int], list[int]],  # (winning params, max query lens it covers)
    decode_flags: dict[str, bool | int] | None,  # flags to add to the decode entries, or None
) -> list[Path]:
    """Write `unified_attention_{2d,3d}-<family>.json` into `out_dir`: the shipped file of that
    family (the default file where there is none) with the prefill class's entry replaced by the
    winner and, if `decode_flags`, the decode classes' entries given those flags. Only files that
    change are written. Returns their paths."""
    written = []
    for kernel in ("unified_attention_2d", "unified_attention_3d"):
        source = CONFIG_DIR / f"{kernel}-{family}.json"
        if not source.exists():
            source = CONFIG_DIR / f"{kernel}-default.json"
        content = json.loads(source.read_text())
        original = json.dumps(content, sort_keys=True)
        content["device"] = family
        if kernel == "unified_attention_2d":
            for max_query_len in prefill[1]:
                replace_entry_params(content, device_name, shape_keys(shape, max_query_len), prefill[0])
        if decode_flags:
            keys = shape_keys(shape, 1)
            current = TunedConfigs([(source, TunedConfigFile.model_validate(content))]).lookup(
                kernel, device_name, **keys
            )
            replace_entry_params(content, device_name, keys, {**current, **decode_flags})  # type: ignore[dict-item]
        if json.dumps(content, sort_keys=True) == original:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{kernel}-{family}.json"
        path.write_text(json.dumps(content, indent=2) + "\n")
        written.append(path)
    return written
