"""Tuned kernel configurations: the JSON file schema and the lookup by kernel, device and shape.

A platform ships tuned launch parameters (warps, stages, tile sizes) as JSON files and returns their
paths from the `pagedserve_tuned_config_files` hook:

    {"schema_version": 1, "kernel": "unified_attention", "device": "h100",
     "configs": [{"match": {"head_size": 128, "max_query_len_le": 1},
                  "params": {"num_warps": 4, "num_stages": 2, "BLOCK_N": 32}}]}

`match` keys are either exact keys (`"head_size": 128` matches shape `head_size == 128`) or bound
keys: `"<name>_le": n` matches `shape[name] <= n`, `"<name>_ge": n` matches `shape[name] >= n`. An
entry matches when all its keys do (an empty `match` matches everything); the first matching entry
of a file wins.

Device fallback order of `TunedConfigs.lookup(kernel, device_name, **shape)`:

1. files whose `device` equals `device_name` exactly ("NVIDIA H100 80GB HBM3");
2. files whose `device` is the family token of `device_name` (`device_family`: "h100");
3. files whose `device` is "default".

Within one level, files are searched in the order the hooks returned them. A level whose files have
no matching entry falls through to the next. If nothing matches, `TunedConfigNotFound` names the
kernel, the device, the shape and every file searched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

DEFAULT_DEVICE = "default"
_BOUND_SUFFIXES = ("_le", "_ge")

MatchValue = StrictInt | StrictStr | StrictBool
ParamValue = StrictInt | StrictFloat | StrictStr | StrictBool
ShapeValue = int | str | bool
Params = dict[str, int | float | str | bool]

# Words of marketing names that never identify a chip family ("Intel(R) Data Center GPU Max 1550").
_VENDOR_WORDS = frozenset(
    {"nvidia", "amd", "intel", "apple", "r", "tm", "geforce", "tesla", "quadro", "instinct", "radeon"}
    | {"data", "center", "gpu", "graphics", "corporation"}
)


class TunedConfigError(ValueError):
    """A tuned-config file cannot be read or is invalid; the message names the file and the field."""


class TunedConfigNotFound(LookupError):
    """No tuned config matches a kernel, device and shape."""


class TunedConfigEntry(BaseModel):
    """One row of a file: when it applies (`match`) and what to launch with (`params`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    match: dict[str, MatchValue] = Field(default_factory=dict)
    params: dict[str, ParamValue] = Field(min_length=1)

    @field_validator("match")
    @classmethod
    def _bounds_are_integers(cls, match: dict[str, MatchValue]) -> dict[str, MatchValue]:
        for key, value in match.items():
            if key.endswith(_BOUND_SUFFIXES):
                if key in _BOUND_SUFFIXES:
                    raise ValueError(f"bound key {key!r} needs a name before the suffix, e.g. 'seq_len{key}'")
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"bound key {key!r} needs an integer, got {value!r}")
        return match


class TunedConfigFile(BaseModel):
    """The whole JSON file: configs of one kernel on one device (name, family token or "default")."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1]
    kernel: str = Field(min_length=1)
    device: str = Field(min_length=1)
    configs: list[TunedConfigEntry] = Field(min_length=1)


def device_family(device_name: str) -> str:
    """The lowercase family token of a device name: "NVIDIA H100 80GB HBM3" -> "h100",
    "AMD Instinct MI300X" -> "mi300x", "NVIDIA A100-SXM4-80GB" -> "a100",
    "NVIDIA GeForce RTX 4090" -> "rtx4090".

    Vendor and brand words are dropped; the token is the first remaining word that contains a digit
    (joined to the word before it when it is only digits). A name without digits gives its first
    remaining word, or the whole lowercased name. Does not mutate."""
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w]
    words = [w for w in words if w not in _VENDOR_WORDS]
    for i, word in enumerate(words):
        if any(c.isdigit() for c in word):
            if word.isdigit() and i > 0 and words[i - 1].isalpha():
                return words[i - 1] + word
            return word
    return words[0] if words else device_name.strip().lower()


def load_tuned_config_file(path: Path) -> TunedConfigFile:
    """Read and validate one file. Raises `TunedConfigError` naming the file and each bad field."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TunedConfigError(f"tuned-config file {path} cannot be read: {e}") from e
    except json.JSONDecodeError as e:
        raise TunedConfigError(f"tuned-config file {path} is not valid JSON: {e}") from e
    try:
        return TunedConfigFile.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<file>'}: {err['msg']}" for err in e.errors()
        )
        raise TunedConfigError(f"tuned-config file {path} is invalid: {problems}") from e


def _entry_matches(entry: TunedConfigEntry, shape: dict[str, ShapeValue], path: Path, index: int) -> bool:
    """Whether every match key of `entry` holds for `shape`. A key naming a shape property the caller
    did not pass is an error (the file and the kernel disagree), not a silent mismatch."""
    for key, want in entry.match.items():
        name, op = key, "eq"
        if key.endswith(_BOUND_SUFFIXES):
            name, op = key[:-3], key[-2:]
        if name not in shape:
            raise TunedConfigError(
                f"tuned-config file {path}, configs[{index}] matches on {name!r} but the lookup only "
                f"passed {sorted(shape)}: fix the file or pass {name}= to lookup()"
            )
        have = shape[name]
        if op == "eq":
            ok = have == want and type(have) is type(want)
        elif isinstance(have, bool) or not isinstance(have, int):
            raise TunedConfigError(f"lookup passed {name}={have!r} but {path} bounds it ({key}): pass an int")
        else:
            assert isinstance(want, int)  # checked by TunedConfigEntry
            ok = have <= want if op == "le" else have >= want
        if not ok:
            return False
    return True


@dataclass(frozen=True, slots=True)
class _LoadedFile:
    path: Path
    content: TunedConfigFile


class TunedConfigs:
    """All tuned-config files of one platform, validated when constructed. Immutable."""

    __slots__ = ("_files",)

    def __init__(self, files: Iterable[tuple[Path, TunedConfigFile]] = ()) -> None:
        self._files = tuple(_LoadedFile(path, content) for path, content in files)

    @classmethod
    def from_files(cls, paths: Sequence[Path]) -> TunedConfigs:
        """Load and validate every file; the first invalid one raises `TunedConfigError`."""
        return cls((Path(p), load_tuned_config_file(Path(p))) for p in paths)

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(f.path for f in self._files)

    def kernels(self) -> list[str]:
        """Kernel names that have at least one file, sorted."""
        return sorted({f.content.kernel for f in self._files})

    def lookup(self, kernel: str, device_name: str, **shape: ShapeValue) -> Params:
        """The params of the first entry matching `shape`, searching devices in the fallback order of
        the module docstring. Raises `TunedConfigNotFound` when nothing matches. Does not mutate."""
        family = device_family(device_name)
        for device_key in dict.fromkeys((device_name, family, DEFAULT_DEVICE)):
            for f in self._files:
                if f.content.kernel != kernel or f.content.device != device_key:
                    continue
                for index, entry in enumerate(f.content.configs):
                    if _entry_matches(entry, shape, f.path, index):
                        return dict(entry.params)
        files = ", ".join(str(p) for p in self.paths) or "none (the platform ships no tuned-config files)"
        raise TunedConfigNotFound(
            f"no tuned config for kernel {kernel!r} on device {device_name!r} (looked for device keys "
            f"{device_name!r}, {family!r}, {DEFAULT_DEVICE!r}) with shape {shape}; files searched: {files}; "
            f"kernels with configs: {self.kernels() or 'none'}"
        )
