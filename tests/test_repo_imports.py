"""Dependencies point one way: no module of the core or of an in-tree plugin imports (at the top,
inside a function, or for annotations only under `if TYPE_CHECKING:`) a module that, through any
chain of imports, imports it back. A type-only import is a dependency too: the two modules cannot
be read, or moved, apart."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _package_dirs() -> list[Path]:
    return [ROOT / "core" / "pagedserve", *sorted(ROOT.glob("plugins/*/pagedserve_*"))]


def _modules() -> dict[str, Path]:
    found = {}
    for pkg in _package_dirs():
        for path in pkg.rglob("*.py"):
            name = ".".join(path.relative_to(pkg.parent).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


@functools.cache  # the tree does not change during a test run; read it once
def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, f"modules that import each other (give the dependency one direction): {cycles}"


def test_the_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _climbs(graph: dict[str, set[str]], floor: str) -> dict[str, list[str]]:
    """Modules under `floor` and what each imports from outside it (the plugin contract's floor
    imports nothing above it). Pure."""
    out = {}
    for name, targets in graph.items():
        if name == floor or name.startswith(f"{floor}."):
            above = sorted(
                t
                for t in targets
                if t.startswith("pagedserve.") and t != floor and not t.startswith(f"{floor}.")
            )
            if above:
                out[name] = above
    return out


def test_the_plugin_contract_imports_nothing_above_it() -> None:
    climbs = _climbs(_import_graph(), "pagedserve.platforms")
    assert not climbs, f"pagedserve.platforms imports the engine above it (move the type down): {climbs}"


def test_the_climb_check_finds_an_import_from_above() -> None:
    graph = {"pagedserve.platforms.api": {"pagedserve.attention.metadata", "pagedserve.platforms.x"}}
    assert _climbs(graph, "pagedserve.platforms") == {
        "pagedserve.platforms.api": ["pagedserve.attention.metadata"]
    }


def test_the_kv_cache_imports_nothing_from_the_scheduler_above_it() -> None:
    graph = _import_graph()
    found = {
        name: sorted(t for t in targets if t.startswith("pagedserve.scheduler"))
        for name, targets in graph.items()
        if name.startswith("pagedserve.kv_cache")
    }
    assert not {k: v for k, v in found.items() if v}, f"the KV cache reaches up into the scheduler: {found}"


def test_tensor_parallel_layout_imports_no_model() -> None:
    """`distributed/` sits below the models: they shard themselves with its layout and layers."""
    graph = _import_graph()
    found = {
        name: sorted(t for t in targets if t.startswith(("pagedserve.models", "pagedserve.moe")))
        for name, targets in graph.items()
        if name.startswith("pagedserve.distributed")
    }
    assert not {k: v for k, v in found.items() if v}, f"distributed/ reaches up into the models: {found}"


# EngineArgs is read where it is defined and resolved (`config`), where an engine is built from it
# (the engine's set-up, and `LLMEngine`, which hands it there), by the processes above the engine
# core that carry it to the cores they start (engine-core processes, data-parallel replicas, API
# servers; never the tensor-parallel ranks, which receive the resolved config), and by the front
# ends above them.
_READERS_OF_ENGINE_ARGS = (
    "pagedserve.config",
    "pagedserve.engine.setup",
    "pagedserve.engine.llm_engine",
    "pagedserve.engine.arg_utils",  # vLLM's import path for EngineArgs
    "pagedserve.engine.async_llm_engine",  # which hands it to LLMEngine
    "pagedserve.engine.process_layer",  # the data-parallel client is opened from it
    "pagedserve.entrypoints",
    "pagedserve.cli",
    "pagedserve.server",
    "pagedserve.processes.data_parallel",
    "pagedserve.processes.engine_core",
    "pagedserve.processes.api_servers",
    "pagedserve.processes.layer",  # which opens the data-parallel client
    "pagedserve.bench",
)


def _engine_args_readers(modules: dict[str, Path]) -> list[str]:
    """Modules that import `EngineArgs` (from `pagedserve.config` or its module) or its module."""
    found = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = {alias.name for alias in node.names}
                if (node.module.startswith("pagedserve.config") and "EngineArgs" in names) or (
                    node.module == "pagedserve.config" and "engine_args" in names
                ):
                    found.append(name)
            elif isinstance(node, ast.Import) and any(
                a.name == "pagedserve.config.engine_args" for a in node.names
            ):
                found.append(name)
    return sorted(set(found))


def test_below_the_engine_nothing_reads_engine_args() -> None:
    """Every part below the engine's set-up (executor, worker, scheduler, models, plugins, ...)
    receives the resolved config of its concern, so a value is resolved once, before any worker
    starts, and no floor below derives it again or sends it back up."""
    readers = _engine_args_readers(_modules())
    below = [name for name in readers if not name.startswith(_READERS_OF_ENGINE_ARGS)]
    assert not below, f"modules below the engine read EngineArgs (give them the config they need): {below}"
    assert "pagedserve.engine.setup" in readers  # the check sees an import where there is one


def _importers_of(graph: dict[str, set[str]], target: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """Modules outside `allowed` (package prefixes) that import `target` or a module under it,
    with what they import of it. Pure."""
    out = {}
    for name, targets in graph.items():
        if name.startswith(allowed):
            continue
        hits = sorted(t for t in targets if t == target or t.startswith(f"{target}."))
        if hits:
            out[name] = hits
    return out


def _benchmark_imports() -> dict[str, set[str]]:
    """What each script under benchmarks/ imports of pagedserve (module names as written)."""
    graph: dict[str, set[str]] = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[f"benchmarks/{path.relative_to(ROOT / 'benchmarks')}"] = found
    return graph


_HTTP_SERVER_USERS = ("pagedserve.server", "pagedserve.cli")


def test_only_the_command_line_imports_the_http_server() -> None:
    """The HTTP server sits at the top, beside the command line that starts it: the processes, the
    offline engine, the benchmarks below them need nothing of it (its engine-core transport lives in
    `pagedserve.processes.engine_core`)."""
    found = _importers_of(_import_graph(), "pagedserve.server", _HTTP_SERVER_USERS)
    found.update(_importers_of(_benchmark_imports(), "pagedserve.server", _HTTP_SERVER_USERS))
    assert not found, f"modules below the server import it (move what they need down): {found}"


def test_the_server_import_check_finds_an_importer() -> None:
    graph = {
        "pagedserve.bench.throughput": {"pagedserve.server.serialization", "pagedserve.engine"},
        "pagedserve.cli.serve": {"pagedserve.server.api_server"},
        "pagedserve.server.chat": {"pagedserve.server.errors"},
        "pagedserve.serverless": {"pagedserve.serverless_helpers"},  # a prefix, not the package
    }
    assert _importers_of(graph, "pagedserve.server", _HTTP_SERVER_USERS) == {
        "pagedserve.bench.throughput": ["pagedserve.server.serialization"]
    }


def _reaches(graph: dict[str, set[str]], floor: str, above: tuple[str, ...]) -> dict[str, list[str]]:
    """Modules under `floor` and what each imports from the packages in `above`. Pure."""
    out = {}
    for name, targets in graph.items():
        if name == floor or name.startswith(f"{floor}."):
            hits = sorted(t for t in targets if any(t == a or t.startswith(f"{a}.") for a in above))
            if hits:
                out[name] = hits
    return out


_ABOVE_THE_PROCESSES = ("pagedserve.server", "pagedserve.entrypoints", "pagedserve.cli")


def test_the_processes_import_nothing_of_the_front_ends_above_them() -> None:
    found = _reaches(_import_graph(), "pagedserve.processes", _ABOVE_THE_PROCESSES)
    assert not found, f"pagedserve.processes reaches up into a front end (move the piece down): {found}"


def test_the_process_check_finds_an_import_from_above() -> None:
    graph = {
        "pagedserve.processes.data_parallel.launch": {"pagedserve.server.early_core", "pagedserve.config"},
        "pagedserve.processes.api_servers": {"pagedserve.entrypoints.llm"},
        "pagedserve.server.async_engine": {"pagedserve.server.metrics"},
    }
    assert _reaches(graph, "pagedserve.processes", _ABOVE_THE_PROCESSES) == {
        "pagedserve.processes.data_parallel.launch": ["pagedserve.server.early_core"],
        "pagedserve.processes.api_servers": ["pagedserve.entrypoints.llm"],
    }


def test_the_engine_imports_nothing_of_the_processes_above_it() -> None:
    """The processes run engines (an engine core per replica, the ranks one core drives), so they
    import the engine; the engine receives what starts them as an argument
    (`engine.process_layer`), never by an import, not even inside a function."""
    found = _reaches(_import_graph(), "pagedserve.engine", ("pagedserve.processes",))
    assert not found, f"pagedserve.engine imports the processes (pass what it needs in instead): {found}"
    assert _reaches(
        {"pagedserve.engine.setup": {"pagedserve.processes.tensor_parallel.launch", "pagedserve.worker"}},
        "pagedserve.engine",
        ("pagedserve.processes",),
    ) == {"pagedserve.engine.setup": ["pagedserve.processes.tensor_parallel.launch"]}


def test_the_tensor_parallel_ranks_sit_below_the_engine_core() -> None:
    """The engine core drives the ranks each step; the ranks know the worker, never the engine or
    the processes (engine cores, replicas) started above it."""
    above = ("pagedserve.engine", "pagedserve.processes.engine_core", "pagedserve.processes.data_parallel")
    found = _reaches(_import_graph(), "pagedserve.processes.tensor_parallel", above)
    assert not found, f"the tensor-parallel ranks reach up (give them the config they need): {found}"
    assert _reaches(
        {"pagedserve.processes.tensor_parallel.worker": {"pagedserve.engine.core"}},
        "pagedserve.processes.tensor_parallel",
        above,
    )
