"""One parse of a GGUF file's metadata per process, shared by config, tokenizer and weights.

transformers reads a GGUF's metadata with gguf-py's `GGUFReader`, which walks every metadata value
as numpy views: for a 49k-token vocabulary that takes seconds. `AutoConfig` and `AutoTokenizer`
each call `load_gguf_checkpoint(return_tensors=False)` for the same file, and mapping GGUF tensor
names to transformers names rebuilds gguf-py's `TensorNameMap` once per submodule (hundreds of
times per model). Within `shared_gguf_reads()` the metadata is parsed once per file version (by
a `GGUFReader` slicing a plain array rather than a `numpy.memmap`, whose Python-level slicing
hooks are most of the parse time) and the name map once per (architecture, layer count); the
weights are then read through transformers' struct-based header reader, which does not walk the
metadata values at all.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

# A few files at most: a process serves one model, and tests or tools may read a second one.
_MAX_CACHED_FILES = 4

FileKey = tuple[str, int, int]  # resolved path, mtime in ns, size: a rewritten file is a new key

_lock = threading.Lock()
_metadata_cache: OrderedDict[FileKey, dict[str, Any]] = OrderedDict()
_name_maps: dict[tuple[Any, int], Any] = {}
_patch_depth = 0
_originals: dict[str, Any] = {}


def file_key(path: str | Path) -> FileKey:
    """What identifies one version of a file: its resolved path, modification time and size.
    Raises `FileNotFoundError` naming the path when it is missing."""
    resolved = Path(path).expanduser().resolve()
    stat = resolved.stat()
    return (str(resolved), stat.st_mtime_ns, stat.st_size)


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """transformers' reading of a GGUF file's metadata (`load_gguf_checkpoint(path,
    return_tensors=False)`: the `config`, `tokenizer` and `tokenizer_config` dicts), parsed once
    per file version in this process. The `config` dict is a fresh copy on each call, since
    callers build configs from it and may change it; the vocabulary lists are shared."""
    key = file_key(path)
    with _lock:
        cached = _metadata_cache.get(key)
        if cached is not None:
            _metadata_cache.move_to_end(key)
    if cached is None:
        # Parsed outside the lock: a second thread asking for the same file at the same time
        # parses it again, which is slower but correct, and other files are not held up.
        with shared_gguf_reads():  # for the faster GGUFReader
            # the module attribute is now the caching wrapper, which would call back here
            cached = _originals["load_gguf_checkpoint"](key[0], return_tensors=False)
        with _lock:
            _metadata_cache[key] = cached
            while len(_metadata_cache) > _MAX_CACHED_FILES:
                _metadata_cache.popitem(last=False)
    return {name: copy.deepcopy(part) if name == "config" else part for name, part in cached.items()}


def _cached_load_gguf_checkpoint(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`load_gguf_checkpoint` answering metadata-only reads from `gguf_metadata`; tensor reads go
    to the original."""

    def load_gguf_checkpoint(
        gguf_checkpoint_path: str,
        return_tensors: bool = False,
        model_to_load: Any = None,
        torch_dtype: Any = None,
    ) -> dict[str, Any]:
        if return_tensors or model_to_load is not None or torch_dtype is not None:
            return original(
                gguf_checkpoint_path,
                return_tensors=return_tensors,
                model_to_load=model_to_load,
                torch_dtype=torch_dtype,
            )
        return gguf_metadata(gguf_checkpoint_path)

    return load_gguf_checkpoint


def _memoized_name_map(original: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
    """gguf-py's `get_tensor_name_map`, built once per (architecture, block count). The map is
    only read (`get_name`) by transformers, so one instance can serve every caller."""

    def get_tensor_name_map(arch: Any, n_blocks: int) -> Any:
        key = (arch, n_blocks)
        with _lock:
            found = _name_maps.get(key)
        if found is None:
            found = original(arch, n_blocks)
            with _lock:
                _name_maps[key] = found
        return found

    return get_tensor_name_map


def _plain_array_reader(base: type[Any]) -> type[Any]:
    """gguf-py's `GGUFReader`, parsing through a plain ndarray view of its memory map. The reader
    slices its data once or twice per metadata value (about 100k times for a 49k-token
    vocabulary); on a `numpy.memmap` each slice runs memmap's `__getitem__` and
    `__array_finalize__` in Python, on a plain view it does not. Same bytes, same fields."""

    class GGUFReader(base):
        @property
        def data(self) -> Any:
            return self._plain_data

        @data.setter
        def data(self, value: Any) -> None:
            # np.asarray: an ndarray view of the map (no copy; read-only for mode 'r')
            self._plain_data = np.asarray(value)

    return GGUFReader


@contextmanager
def shared_gguf_reads() -> Iterator[None]:
    """While open, transformers' GGUF metadata reads (`AutoConfig`/`AutoTokenizer` with
    `gguf_file=`) come from `gguf_metadata`, gguf-py's tensor name map is memoized and its
    `GGUFReader` is `_plain_array_reader`'s.

    transformers imports these inside the functions that use them, so replacing the
    module attributes reaches every caller. The replacements return what the originals would, so
    other threads that happen to call them meanwhile get the same answers. Nested and concurrent
    scopes share one installation, removed when the last one closes."""
    global _patch_depth
    import gguf
    from transformers import modeling_gguf_pytorch_utils

    with _lock:
        if _patch_depth == 0:
            _originals["load_gguf_checkpoint"] = modeling_gguf_pytorch_utils.load_gguf_checkpoint
            _originals["get_tensor_name_map"] = gguf.get_tensor_name_map
            _originals["GGUFReader"] = gguf.GGUFReader
            gguf.GGUFReader = _plain_array_reader(_originals["GGUFReader"])  # type: ignore[misc]
            modeling_gguf_pytorch_utils.load_gguf_checkpoint = _cached_load_gguf_checkpoint(
                _originals["load_gguf_checkpoint"]
            )
            gguf.get_tensor_name_map = _memoized_name_map(_originals["get_tensor_name_map"])  # type: ignore[assignment]
        _patch_depth += 1
    try:
        yield
    finally:
        with _lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                modeling_gguf_pytorch_utils.load_gguf_checkpoint = _originals.pop("load_gguf_checkpoint")
                gguf.get_tensor_name_map = _originals.pop("get_tensor_name_map")
                gguf.GGUFReader = _originals.pop("GGUFReader")  # type: ignore[misc]
