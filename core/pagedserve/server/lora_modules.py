"""The server's LoRA adapters (`pagedserve serve --enable-lora --lora-modules ...`): parsing the
flag's entries, as vLLM's server takes them, into named adapters with their engine ids.

An entry is `name=path` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`
(`base_model_name` optional: the `parent` shown in /v1/models, by default the served model's
name). The adapters get lora_int_id 1..n in the order given. A request selects one by sending its
name as `model`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pagedserve.lora.request import LoRARequest

_JSON_KEYS = frozenset({"name", "path", "base_model_name"})


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapter the server serves under its own model name."""

    name: str  # the `model` clients send to select it
    path: str  # the PEFT adapter folder
    lora_int_id: int  # its id inside the engine (>= 1)
    base_model_name: str | None = None  # the parent /v1/models shows; None: the served model's name

    @property
    def lora_request(self) -> LoRARequest:
        return LoRARequest(self.name, self.lora_int_id, self.path)


def parse_lora_modules(entries: list[str], served_model_name: str) -> tuple[LoRAModule, ...]:
    """The adapters of `--lora-modules` entries, with lora_int_id 1..n in order. Raises ValueError
    (one line, naming the entry) for an entry that is neither `name=path` nor vLLM's JSON object,
    an empty name or path, a name given twice, or a name equal to the served model's. Pure."""
    modules: list[LoRAModule] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries, start=1):
        name, path, base = _parse_entry(entry)
        if name == served_model_name:
            raise ValueError(
                f"--lora-modules: adapter name {name!r} is the served model's name: requests naming "
                "it would be ambiguous; rename the adapter (or pass another --served-model-name)"
            )
        if name in seen:
            raise ValueError(f"--lora-modules: adapter name {name!r} is given twice: names must be unique")
        seen.add(name)
        modules.append(LoRAModule(name, path, index, base))
    return tuple(modules)


def _parse_entry(entry: str) -> tuple[str, str, str | None]:
    """(name, path, base_model_name) of one entry. Raises ValueError naming it."""
    text = entry.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: {entry!r} is not valid JSON ({exc.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"--lora-modules: {entry!r} must be a JSON object")
        unknown = sorted(set(value) - _JSON_KEYS)
        if unknown:
            raise ValueError(
                f"--lora-modules: {entry!r} has unknown keys {unknown} (accepted: name, path, "
                "base_model_name)"
            )
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        for key, field in (("name", name), ("path", path)):
            if not isinstance(field, str) or not field:
                raise ValueError(f"--lora-modules: {entry!r} needs a non-empty string {key!r}")
        if base is not None and (not isinstance(base, str) or not base):
            raise ValueError(f"--lora-modules: {entry!r}: base_model_name must be a non-empty string")
        assert isinstance(name, str) and isinstance(path, str)
        return name, path, base
    name, sep, path = entry.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {entry!r} is not name=path (or a JSON object with name and path)")
    return name, path, None
