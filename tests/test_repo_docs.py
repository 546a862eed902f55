"""The repository documents itself: docs/structure.md maps every module, and .ci/run runs the
README's test command (nothing weaker)."""

from __future__ import annotations

import argparse
import importlib.metadata
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


_PATH_IN_BACKTICKS = re.compile(r"`((?:core|plugins|benchmarks|docs|tests|examples)/[^`\s]*)`")
# Placeholders a reader fills in (`configs/cuda_paged_attention-<device>.json`, `DIR`), not files.
_PLACEHOLDER = re.compile(r"[<>]|\b[A-Z]{3,}\b")


def _expand_braces(pattern: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end() :]
    return [p for alt in match.group(1).split(",") for p in _expand_braces(head + alt + tail)]


def _doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("plugins/*/*/*.md"))]


def test_docs_name_only_files_that_exist() -> None:
    missing = []
    for doc in _doc_files():
        for ref in _PATH_IN_BACKTICKS.findall(doc.read_text()):
            if _PLACEHOLDER.search(ref):
                continue
            for pattern in _expand_braces(ref.rstrip("/").split("::")[0]):
                if not any(ROOT.glob(pattern)):
                    missing.append(f"{doc.relative_to(ROOT)}: {pattern}")
    assert not missing, f"docs name files that do not exist: {missing}"


def test_every_platform_plugin_is_described_in_the_architecture() -> None:
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for plugin in sorted(p.name for p in (ROOT / "plugins").iterdir() if p.is_dir()):
        assert f"* `{plugin}` —" in architecture, f"docs/architecture.md does not describe plugins/{plugin}"


# How the project was made is not what it is: users know nothing of work sessions, tracker
# numbers or the tools behind them.
_MAKING = re.compile(
    r"\bsessions? \d|\bsess[i]on's\b|\bissues? #?\d|\bdevic[e] tool\b"
    r"|\bother engineer[s]\b|\bengineers' job[s]\b",
    re.IGNORECASE,
)


def test_nothing_narrates_how_the_project_was_made() -> None:
    suffixes = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".json"}
    found = []
    for path in [*ROOT.glob("*.md"), *ROOT.glob("*.toml"), *(ROOT / ".ci").glob("*")]:
        found += [f"{path.name}: {m.group(0)}" for m in _MAKING.finditer(path.read_text())]
    for top in (*CODE_DIRS, "docs", "tests"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in suffixes or "__pycache__" in path.parts or path.name == Path(__file__).name:
                continue
            if any(p.endswith(".egg-info") for p in path.parts) or path.stat().st_size > 2_000_000:
                continue
            text = path.read_text(errors="replace")
            found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in _MAKING.finditer(text)]
    assert not found, f"text that narrates the project's making: {found[:20]}"


# `pagedserve SUBCOMMAND [SUBSUBCOMMAND] ... --flag` in a doc: the flags a reader would type.
_COMMAND = re.compile(r"\bpagedserve((?: [a-z][a-z-]*)+)((?: [^`\n#]*)?)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers of `parser` by name (empty when it has none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _doc_commands() -> list[tuple[str, str]]:
    """(doc, command line) for every `pagedserve ...` command the docs show, with `\\` line
    continuations joined and trailing `# comments` dropped."""
    found = []
    for doc in _doc_files():
        text = doc.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            for match in _COMMAND.finditer(line):
                found.append((doc.relative_to(ROOT).as_posix(), match.group(0)))
    return found


def test_docs_show_only_cli_flags_that_exist() -> None:
    from pagedserve.cli.main import build_parser

    top = build_parser()
    problems = []
    for doc, command in _doc_commands():
        words = command.split()[1:]
        parser = top
        path = ["pagedserve"]
        while words and words[0] in _subparsers(parser):
            path.append(words[0])
            parser = _subparsers(parser)[words.pop(0)]
        if parser is top:
            continue  # prose such as "pagedserve is ...", not a command
        known = set(parser._option_string_actions)
        for flag in _FLAG.findall(" ".join(words)):
            if flag not in known:
                problems.append(f"{doc}: `{' '.join(path)}` has no {flag}")
    assert not problems, f"docs show CLI flags the parser does not have: {problems}"


def test_docs_name_only_pagedserve_variables_the_code_defines() -> None:
    code = "\n".join(path.read_text() for top in ("core", "plugins") for path in (ROOT / top).rglob("*.py"))
    problems = []
    for doc in _doc_files():
        for name in sorted(set(re.findall(r"\bPAGEDSERVE_[A-Z0-9_]+\b", doc.read_text()))):
            if f'"{name}"' not in code:
                problems.append(f"{doc.relative_to(ROOT)}: {name}")
    assert not problems, f"docs name PAGEDSERVE_* names that no code defines: {problems}"


def test_docs_name_only_pagedserve_modules_and_attributes_that_exist() -> None:
    import importlib

    problems = []
    for doc in _doc_files():
        for name in sorted(set(re.findall(r"`(pagedserve(?:\.\w+)+)`", doc.read_text()))):
            parts = name.split(".")
            # The longest importable module prefix, then attributes down from it.
            for cut in range(len(parts), 0, -1):
                try:
                    obj: object = importlib.import_module(".".join(parts[:cut]))
                except ModuleNotFoundError:
                    continue
                break
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    problems.append(f"{doc.relative_to(ROOT)}: {name}")
                    break
                obj = getattr(obj, attr)
    assert not problems, f"docs name pagedserve modules or attributes that do not exist: {problems}"


def test_results_index_lists_every_entry() -> None:
    results = ROOT / "docs" / "results"
    index = (results / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+?)/?` \|", index, flags=re.MULTILINE))
    present = {p.name for p in results.iterdir() if p.name != "README.md"}
    assert present - listed == set(), f"docs/results/README.md does not list {sorted(present - listed)}"
    gone = sorted(listed - present)
    assert not gone, f"docs/results/README.md lists entries that are gone: {gone}"


# Every folder of benchmarks/ that holds scripts; each one's __init__.py names each of them.
_BENCHMARK_FOLDERS = ("", "kernel_benchmarks", "suite", "investigations", "common")


def test_benchmarks_map_names_every_script() -> None:
    for folder in (ROOT / "benchmarks" / name for name in _BENCHMARK_FOLDERS):
        doc = (folder / "__init__.py").read_text()
        named = set(re.findall(r"^  (\w+\.py)\b", doc, flags=re.MULTILINE))
        scripts = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
        where = folder.relative_to(ROOT)
        assert scripts - named == set(), f"{where}/__init__.py does not place {sorted(scripts - named)}"
        assert named - scripts == set(), (
            f"{where}/__init__.py names scripts that are gone: {sorted(named - scripts)}"
        )


def test_no_benchmark_module_shadows_an_installed_package() -> None:
    # The scripts run with their folder first on sys.path, and tests and spawned workers inherit
    # that path: a script or folder named like an installed package (transformers imports
    # `kernels`, for one) would be imported in its place.
    installed = set(importlib.metadata.packages_distributions())
    for folder in (ROOT / "benchmarks" / name for name in _BENCHMARK_FOLDERS):
        names = {p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
        names |= {p.name for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
        clash = sorted(names & installed)
        assert not clash, f"{folder.relative_to(ROOT)} has modules named like installed packages: {clash}"


def test_benchmarks_top_level_holds_only_what_a_user_runs() -> None:
    # What a user runs stays in sight; one-off investigations, kernels and the suite's parts have
    # folders of their own, so the top level stays a short list.
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")
    assert len(scripts) <= 13, f"benchmarks/ has {len(scripts)} scripts at its top level: {scripts}"
    folders = {p.name for p in (ROOT / "benchmarks").iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(_BENCHMARK_FOLDERS), f"benchmarks/ folders not mapped: {sorted(folders)}"


def test_investigations_readme_says_what_each_script_answered() -> None:
    folder = ROOT / "benchmarks" / "investigations"
    listed = set(re.findall(r"^\| `(\w+\.py)` \| \S", (folder / "README.md").read_text(), flags=re.M))
    scripts = {p.name for p in folder.glob("*.py") if p.name != "__init__.py"}
    assert listed == scripts, f"investigations/README.md: {sorted(listed)}; the folder: {sorted(scripts)}"
