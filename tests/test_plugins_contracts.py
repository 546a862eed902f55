"""Contract hygiene: every hook is documented (docstring and docs/plugins.md), and the engine's
options name the bad field in their validation errors."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path

import pydantic
import pytest

from pagedserve.config import EngineArgs
from pagedserve.platforms import hookspecs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def _hookspecs() -> dict[str, Callable[..., object]]:
    marker = f"{hookspecs.PROJECT_NAME}_spec"  # the attribute pluggy's HookspecMarker sets
    return {
        name: fn for name, fn in vars(hookspecs).items() if inspect.isfunction(fn) and hasattr(fn, marker)
    }


def test_there_are_hookspecs() -> None:
    assert "pagedserve_platforms" in _hookspecs()
    assert len(_hookspecs()) >= 5


@pytest.mark.parametrize("name", sorted(_hookspecs()))
def test_every_hookspec_has_a_docstring(name: str) -> None:
    doc = inspect.getdoc(_hookspecs()[name]) or ""
    assert len(doc.split()) >= 8, f"hookspec {name} needs a docstring saying what to return and when"


@pytest.mark.parametrize("name", sorted(_hookspecs()))
def test_every_hookspec_is_in_the_plugin_guide(name: str) -> None:
    assert f"`{name}" in DOCS.read_text(), f"docs/plugins.md does not document hook {name}"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"swap_space_gib": -1}, "swap_space_gib"),
        ({"blok_size": 16}, "blok_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"preemption_mode": "pause"}, "preemption_mode"),
    ],
)
def test_config_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        EngineArgs(**kwargs)
