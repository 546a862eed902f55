"""Compiled forwards saved whole on disk, so that a later start skips dynamo's tracing.

Why. Inductor's disk cache keeps the generated code, but every start still re-runs dynamo over
the forward to find it: on a 32-layer model that tracing is most of a warm start. torch's
`aot_compile` packages what dynamo and inductor produced (the bytecode, its guards and the
compiled code) into one file, and `torch.compiler.load_compiled_function` turns it back into a
callable in a few seconds.

What a file holds. One graph of one model's forward for one size class, compiled from the
unbound `forward` with the module as its first argument: parameters are read from the module at
each call, never baked in. The key (`graph_key`) changes whenever the traced graph could: torch's
and pagedserve's versions, Python's, the source of every module class the model is built from and
of the modules the trace goes through, the model's spec, every parameter's and buffer's name,
shape and dtype, the device type and the size class. Files live under the compile cache root
(`compile_cache_root`, the one `gpu_compile.configure_compile_caches` uses), in `aot/`.

Failure. A file that does not load (truncated, written by another torch) or whose guards reject
the first warm-up call is compiled again and rewritten, with one warning saying why; the engine
never runs a graph whose guards did not accept its inputs.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

# Bumped when what is saved changes meaning (the compile options, the guard policy).
FORMAT_VERSION = 1
SUBDIR = "aot"
# The package's folder, found from this file: importing `pagedserve` itself here would make the
# package and its engine modules import each other.
_PACKAGE_DIR = Path(__file__).resolve().parents[2]
# Sources every traced forward goes through besides the model's own module classes.
_TRACED_SOURCES = (
    _PACKAGE_DIR / "attention" / "layer.py",
    _PACKAGE_DIR / "attention" / "forward_context.py",
    _PACKAGE_DIR / "attention" / "metadata.py",
    Path(__file__),
)

CompiledFn = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class GraphOrigin:
    """How one graph became ready at warm-up: read from its file or compiled (and saved)."""

    size: int
    how: Literal["loaded", "compiled"]
    seconds: float


def compile_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedserve`, else `~/.cache/pagedserve`:
    the root under which compile caches persist. Pure."""
    env = os.environ if environ is None else environ
    explicit = env.get("PAGEDSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedserve"


def saved_compiles_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The folder of saved compiled forwards. Pure."""
    return compile_cache_root(environ) / SUBDIR


def _source_files(model: torch.nn.Module) -> list[Path]:
    files = {p.resolve() for p in _TRACED_SOURCES}
    files.update(p.resolve() for p in (_PACKAGE_DIR / "models").glob("*.py"))
    for module in model.modules():
        try:
            source = inspect.getsourcefile(type(module))
        except TypeError:  # a class without a Python file (built in) cannot change under us
            continue
        if source is not None:
            files.add(Path(source).resolve())
    return sorted(files)


def _pagedserve_version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree: the sources are hashed
        return "not installed"


def graph_key(model: torch.nn.Module, spec: object, device_type: str, size_class: str) -> str:
    """Hex digest naming the compiled graph of `model`'s forward for `size_class` on
    `device_type`; equal keys mean the trace would produce the same graph. Reads the source files."""
    digest = hashlib.sha256()

    def add(*parts: object) -> None:
        for part in parts:
            digest.update(str(part).encode())
            digest.update(b"\0")

    add(FORMAT_VERSION, torch.__version__, _pagedserve_version(), sys.version, device_type, size_class)
    add(type(model).__module__, type(model).__qualname__, repr(spec))
    for path in _source_files(model):
        add(path.name)
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    for name, module in model.named_modules():
        add(name, type(module).__module__, type(module).__qualname__)
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        add(name, tuple(tensor.shape), tensor.dtype, tensor.device.type)
    return digest.hexdigest()


def save_atomically(fn: CompiledFn, path: Path) -> None:
    """Write `fn` (an `aot_compile` result) to `path` through a temporary file in the same folder,
    so a reader never sees half a file. Creates the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(handle)
    try:
        fn.save_compiled_function(tmp)  # type: ignore[attr-defined]  # an AOTCompiledFunction
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def load_or_compile(
    path: Path | None,
    size: int,
    compile_graph: Callable[[], CompiledFn],
    first_call: Callable[[CompiledFn], object],
) -> tuple[CompiledFn, GraphOrigin]:
    """The graph saved at `path` when it loads and `first_call` accepts it, else a fresh
    `compile_graph()` (run through `first_call`, then saved at `path`). `path` None: compile
    without saving. Errors of compiling or of the fresh graph's first call propagate; a file that
    cannot be used, or saved, only logs a warning."""
    start = time.perf_counter()
    if path is not None and path.exists():
        try:
            with open(path, "rb") as f:
                loaded = torch.compiler.load_compiled_function(f)
            first_call(loaded)  # checks the guards; raises when they reject this setup
            return loaded, GraphOrigin(size, "loaded", time.perf_counter() - start)
        except Exception as exc:  # unpickling and guard failures have many types; all mean recompile
            why = _first_line(exc)
            logger.warning("saved compiled forward %s not used (%s); compiling it again", path, why)
    compiled = compile_graph()
    first_call(compiled)
    if path is not None:
        try:
            save_atomically(compiled, path)
        except Exception as exc:  # a full disk or an unpicklable graph must not stop the engine
            logger.warning("could not save the compiled forward to %s (%s)", path, _first_line(exc))
    return compiled, GraphOrigin(size, "compiled", time.perf_counter() - start)
