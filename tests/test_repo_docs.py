"""The repository documents itself: docs/structure.md maps every module, and .ci/run runs the
README's test command (nothing weaker)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("core", "plugins", "examples", "benchmarks")


def _modules() -> set[str]:
    found = set()
    for top in CODE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            if "__pycache__" in path.parts or any(p.endswith(".egg-info") for p in path.parts):
                continue
            found.add(path.relative_to(ROOT).as_posix())
    return found


def _listed() -> set[str]:
    text = (ROOT / "docs" / "structure.md").read_text()
    return set(re.findall(r"^- `([^`]+\.py)`", text, flags=re.M))


def test_structure_md_lists_every_module() -> None:
    missing = sorted(_modules() - _listed())
    assert not missing, f"docs/structure.md has no line for: {missing}"


def test_structure_md_lists_nothing_that_is_gone() -> None:
    stale = sorted(_listed() - _modules())
    assert not stale, f"docs/structure.md lists modules that do not exist: {stale}"


def _code_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command() -> None:
    readme_blocks = _code_blocks((ROOT / "README.md").read_text())
    assert len(readme_blocks) >= 2, "README must start with the two set-up commands"
    test_command = readme_blocks[1]
    assert "pytest" in test_command
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, "the README's test command and .ci/run's differ"
