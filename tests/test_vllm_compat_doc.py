"""docs/vllm_compat.md stays true: every row marked same or different names something that exists
under that name in pagedserve, and every row marked absent names something that does not."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path

import pytest

from pagedserve.config import EngineArgs
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm_compat.md"
# Where the rows of kind "class" are looked up (the modules vLLM users import them from, renamed).
_CLASS_MODULES = ("pagedserve", "pagedserve.sampling_params", "pagedserve.lora.request")


def _rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


def _exists(name: str, kind: str) -> bool:
    if kind == "LLM method":
        return hasattr(LLM, name)
    if kind == "LLM argument":
        # vLLM's name may differ from ours ("different"): the notes give ours, the row vLLM's.
        return name in EngineArgs.model_fields
    if kind == "SamplingParams field":
        names = {f.name for f in dataclasses.fields(SamplingParams)}
        return name in names or name in SamplingParams.__dataclass_fields__
    if kind == "generate argument":
        return name in inspect.signature(LLM.generate).parameters
    if kind == "class":
        return any(hasattr(importlib.import_module(module), name) for module in _CLASS_MODULES)
    if kind == "module":  # vLLM's module path, with pagedserve in place of vllm
        return importlib.util.find_spec(name.replace("vllm", "pagedserve", 1)) is not None
    if kind == "engine method":  # Class.method, the class from pagedserve
        cls_name, method = name.split(".")
        return hasattr(getattr(importlib.import_module("pagedserve"), cls_name), method)
    if kind == "server field":
        return name in CompletionRequest.model_fields or name in ChatCompletionRequest.model_fields
    raise AssertionError(f"unknown kind {kind!r} in {DOC.name}")


def test_the_table_has_rows_of_every_kind() -> None:
    kinds = {kind for _, kind, _ in _rows()}
    assert kinds == {
        "LLM method",
        "LLM argument",
        "generate argument",
        "class",
        "SamplingParams field",
        "server field",
        "module",
        "engine method",
    }


@pytest.mark.parametrize(("name", "kind", "status"), _rows())
def test_each_row_matches_the_code(name: str, kind: str, status: str) -> None:
    assert status in ("same", "different", "absent")
    exists = _exists(name, kind)
    if status == "absent":
        assert not exists, f"{name} ({kind}) exists now: update its row in {DOC.name}"
    elif name == "swap_space":
        assert "swap_space_gib" in EngineArgs.model_fields  # listed under vLLM's name
    else:
        assert exists, f"{name} ({kind}) is marked {status} in {DOC.name} but does not exist"
