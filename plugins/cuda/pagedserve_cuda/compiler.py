"""NVRTC compilation of the plugin's CUDA C++ sources, with an on-disk cubin cache.

Kernels are compiled at first use for the exact GPU architecture (`sm_90` on an H100), so
`pip install 'pagedserve[cuda]'` needs no CUDA toolkit and no nvcc: NVRTC comes as a wheel
(`nvidia-cuda-nvrtc`, which torch's CUDA wheels already pull in) and is driven through cuda-python
(`cuda.bindings.nvrtc`).

The cache file is `<cache dir>/<sha256>.cubin`, where the hash covers the full source text, the
compile options (defines included), the architecture and the NVRTC version: any change compiles
anew, and a stale file can never be picked up. The cache dir is `$PAGEDSERVE_CUDA_CACHE` if set,
else `$XDG_CACHE_HOME/pagedserve/cuda`, else `~/.cache/pagedserve/cuda`. Files are written to a
temporary name and renamed, so concurrent processes never read a half-written cubin.

Importing this module imports nothing from cuda-python; `load_nvrtc` does, on first use.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

CACHE_ENV = "PAGEDSERVE_CUDA_CACHE"
INSTALL_HINT = "pip install 'pagedserve[cuda]'"
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
COMMON_HEADER = "common.cuh"
PROGRAMMATIC_HEADER = "programmatic.cuh"  # prepended to every source: PS_AWAIT_PREVIOUS_KERNEL


class CudaToolError(RuntimeError):
    """cuda-python or the NVRTC library is missing or unusable; the message says what to install."""


class CudaCompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message carries NVRTC's log."""


@dataclass(frozen=True, slots=True)
class KernelSource:
    """One compilable unit: a .cu file of `kernels/`, prefixed with `programmatic.cuh` and optionally
    `common.cuh`, and the -D defines that specialise it (dtype, head size, thread counts,
    DEPENDENT for a programmatic dependent launch)."""

    file: str  # file name inside kernels/
    defines: tuple[tuple[str, int], ...]  # (name, value), in a fixed order: part of the cache key
    with_common: bool = True

    def text(self) -> str:
        """The full source NVRTC sees. Reads the files (cached per process). Does not mutate."""
        parts = [_read_kernel_file(PROGRAMMATIC_HEADER)]
        if self.with_common:
            parts.append(_read_kernel_file(COMMON_HEADER))
        parts.append(_read_kernel_file(self.file))
        return "\n".join(parts)

    def options(self, arch: str) -> list[str]:
        """NVRTC options: the architecture, C++17 and the defines. No --use_fast_math: the kernels
        call the fast intrinsics (`__expf`) where they want them and keep IEEE division elsewhere."""
        return [
            f"--gpu-architecture={arch}",
            "--std=c++17",
            "-default-device",
            *(f"-D{name}={value}" for name, value in self.defines),
        ]


@functools.cache
def _read_kernel_file(name: str) -> str:
    return (KERNEL_DIR / name).read_text(encoding="utf-8")


def load_nvrtc() -> ModuleType:
    """`cuda.bindings.nvrtc`, after checking that libnvrtc loads. Raises `CudaToolError` naming the
    missing piece and the install command."""
    try:
        nvrtc = importlib.import_module("cuda.bindings.nvrtc")
    except Exception as e:  # ImportError, or a broken install raising anything else
        raise CudaToolError(
            f"cuda-python cannot be imported ({type(e).__name__}: {e}); {INSTALL_HINT}"
        ) from e
    try:
        err, _, _ = nvrtc.nvrtcVersion()
    except Exception as e:  # cuda.bindings raises when it cannot dlopen libnvrtc
        raise CudaToolError(
            f"the NVRTC library cannot be loaded ({type(e).__name__}: {e}); {INSTALL_HINT} "
            "(it installs the nvidia-cuda-nvrtc wheel)"
        ) from e
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaToolError(f"nvrtcVersion failed with {err}; {INSTALL_HINT}")
    return nvrtc


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC library. Raises `CudaToolError` if it is missing."""
    nvrtc = load_nvrtc()
    _, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


def cache_dir() -> Path:
    """Where compiled cubins are kept (see the module docstring). Does not create it."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return root / "pagedserve" / "cuda"


def cache_key(source: str, options: list[str], arch: str, version: tuple[int, int]) -> str:
    """The sha256 hex digest naming a cubin: source, options, arch and NVRTC version. Pure."""
    digest = hashlib.sha256()
    for part in (source, "\0".join(options), arch, f"nvrtc {version[0]}.{version[1]}"):
        digest.update(part.encode())
        digest.update(b"\x1f")
    return digest.hexdigest()


def _check(nvrtc: ModuleType, err: object, what: str) -> None:
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CudaCompileError(f"{what} failed: {err}")


def compile_to_cubin(source: str, name: str, options: list[str]) -> bytes:
    """Compile `source` with NVRTC and return the cubin. Raises `CudaCompileError` with NVRTC's log
    when the source does not compile (or the architecture is unknown to this NVRTC)."""
    nvrtc = load_nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(nvrtc, err, f"nvrtcCreateProgram({name})")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            text = log.decode(errors="replace").rstrip("\x00 \n")
            raise CudaCompileError(
                f"NVRTC {'.'.join(map(str, nvrtc_version()))} could not compile {name} with options "
                f"{' '.join(options)}:\n{text}"
            )
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, f"nvrtcGetCUBINSize({name})")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(nvrtc, err, f"nvrtcGetCUBIN({name})")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cached_cubin(kernel: KernelSource, arch: str) -> bytes:
    """The cubin of `kernel` for `arch` ("sm_90"): read from the disk cache, or compiled and stored.
    An unwritable cache dir only costs recompiling next time. Mutates the cache dir."""
    source = kernel.text()
    options = kernel.options(arch)
    key = cache_key(source, options, arch, nvrtc_version())
    path = cache_dir() / f"{key}.cubin"
    if path.is_file():
        return path.read_bytes()
    cubin = compile_to_cubin(source, kernel.file, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(cubin)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        # A read-only home still works: this process keeps the cubin, the next one recompiles.
        logger.warning(
            "cannot write the CUDA kernel cache %s (%s); set %s to a writable dir", path, e, CACHE_ENV
        )
    return cubin
