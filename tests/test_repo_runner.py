"""The model runner is built by construction: start-up makes its KV cache, graphs and compiled
forwards and hands them to `ModelRunner(...)`, and no module but the runner's own assigns (or
deletes, or `setattr`s) an attribute of a runner afterwards. A runner that others fill in from
outside has no one place that says what it holds or when it is ready.

Which expressions are runners is read from the code: names and attributes called `runner` or
`_runner`, names annotated `ModelRunner`, and names bound to `ModelRunner(...)` or
`build_runner(...)`."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNER_FILE = ROOT / "core" / "pagedserve" / "worker" / "model_runner.py"
SEARCHED = ("core", "plugins", "examples", "benchmarks", "tests")
_RUNNER_NAMES = frozenset({"runner", "_runner"})
_BUILDERS = frozenset({"ModelRunner", "build_runner"})
_SETTERS = frozenset({"setattr", "__setattr__", "delattr"})


def _last_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _annotated_runner(annotation: ast.expr | None) -> bool:
    return annotation is not None and "ModelRunner" in ast.unparse(annotation)


def _builds_runner(node: ast.AST) -> bool:
    """`x = ModelRunner(...)` or `x = build_runner(...)`."""
    return (
        isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Call)
        and _last_name(node.value.func) in _BUILDERS
    )


def _sets_runner_attribute(node: ast.AST, runners: set[str]) -> ast.expr | None:
    """The runner of `setattr(runner, ...)`, `monkeypatch.setattr(runner, ...)`,
    `object.__setattr__(runner, ...)` or `delattr(runner, ...)`; None for any other node."""
    if isinstance(node, ast.Call) and _last_name(node.func) in _SETTERS and node.args:
        first = node.args[0]
        return first if _last_name(first) in runners else None
    return None


def _runner_names(tree: ast.AST) -> set[str]:
    """Local names this module binds to a runner: annotated `ModelRunner`, or assigned from a
    call of `ModelRunner` or `build_runner`."""
    names = set(_RUNNER_NAMES)
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and _annotated_runner(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if _annotated_runner(node.annotation):
                names.add(node.target.id)
        elif _builds_runner(node):
            assert isinstance(node, ast.Assign)
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _targets(node: ast.AST) -> list[ast.expr]:
    """The expressions `node` binds or deletes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    flat: list[ast.expr] = []
    while found:
        target = found.pop()
        if isinstance(target, ast.Tuple | ast.List):
            found.extend(target.elts)
        else:
            flat.append(target)
    return flat


def runner_attribute_writes(source: str) -> list[str]:
    """`line: code` of every write to an attribute of a runner in `source`. Pure."""
    tree = ast.parse(source)
    runners = _runner_names(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        written = [
            t.value for t in _targets(node) if isinstance(t, ast.Attribute) and _last_name(t.value) in runners
        ]
        target = _sets_runner_attribute(node, runners)
        if target is not None:
            written.append(target)
        if written:
            line = getattr(node, "lineno", 0)
            found.append((line, f"{line}: {ast.unparse(node).splitlines()[0]}"))
    return [text for _, text in sorted(found)]


def test_no_module_but_the_runners_sets_its_attributes() -> None:
    found = {}
    for top in SEARCHED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == RUNNER_FILE or ".venv" in path.parts or "__pycache__" in path.parts:
                continue
            writes = runner_attribute_writes(path.read_text())
            if writes:
                found[path.relative_to(ROOT).as_posix()] = writes
    assert not found, (
        "modules set attributes of a model runner from outside it (build the part before the runner "
        f"and pass it to ModelRunner(...), or wrap the runner instead of patching it): {found}"
    )


PLANTED = """
def build(dm, kv, lora):
    runner = build_runner(dm)
    runner.lora = lora
    self._runner.forward, other = None, 1
    setattr(runner, "startup_times", None)
    monkeypatch.setattr(core.runner, "execute", None)
    del engine.core.runner.launch
    self.runner = runner  # binds an attribute of something else: allowed
    runner_count = runner.model  # reads: allowed


def typed(mine: ModelRunner) -> None:
    mine.compiled = None
    made = ModelRunner(model)
    made.kv_caches += []
"""


def test_the_check_finds_planted_writes() -> None:
    assert runner_attribute_writes(PLANTED) == [
        "4: runner.lora = lora",
        "5: self._runner.forward, other = (None, 1)",
        "6: setattr(runner, 'startup_times', None)",
        "7: monkeypatch.setattr(core.runner, 'execute', None)",
        "8: del engine.core.runner.launch",
        "14: mine.compiled = None",
        "16: made.kv_caches += []",
    ]
