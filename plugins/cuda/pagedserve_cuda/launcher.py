"""Loading compiled kernels into torch's CUDA context and launching them on torch's current stream,
through the CUDA driver API of cuda-python (`cuModuleLoadData`, `cuModuleGetFunction`,
`cuLaunchKernel`, and `cuLaunchKernelEx` for programmatic dependent launches).

Launches happen once per layer per step, so the hot path is short: a `CudaKernel` keeps its
`CUfunction` and a preallocated parameter block (one 8-byte slot per argument plus the `void*`
array pointing at the slots). A launch is one `struct.pack_into` of the arguments into that block
and one `cuLaunchKernel` call with the block's address; the driver copies the parameters during
the call, so the block is reusable at once. Nothing here synchronises with the device. The block
is one per kernel, so packing and launching hold the kernel's lock: the start-up sweep launches
from several threads (an uncontended lock costs well under a microsecond; a launch, several).

Modules are loaded once per (kernel source, device) and kept for the life of the process. Different
modules compile at the same time on different threads (NVRTC runs outside Python's lock); one module
compiles once.
"""

from __future__ import annotations

import ctypes
import importlib
import struct
import threading
from types import ModuleType
from typing import Any

import torch

from pagedserve_cuda.compiler import INSTALL_HINT, CudaToolError, KernelSource, cached_cubin

# Argument kinds of a kernel signature: "p" pointer, "q" int64, "i" int32, "f" float32. Each takes
# one 8-byte slot (4-byte kinds are padded), so slot i always starts at 8 * i.
_SLOT_FORMAT = {"p": "Q", "q": "q", "i": "i4x", "f": "f4x"}


class CudaLaunchError(RuntimeError):
    """A driver call failed (module load, function lookup or launch); the message names it."""


def load_driver() -> ModuleType:
    """`cuda.bindings.driver`, initialised (`cuInit`). Raises `CudaToolError` naming the install."""
    try:
        driver = importlib.import_module("cuda.bindings.driver")
    except Exception as e:
        raise CudaToolError(
            f"cuda-python cannot be imported ({type(e).__name__}: {e}); {INSTALL_HINT}"
        ) from e
    _check(driver, driver.cuInit(0)[0], "cuInit")
    return driver


def _check(driver: ModuleType, err: Any, what: str) -> None:
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise CudaLaunchError(f"{what} failed: {name.decode() if isinstance(name, bytes) else err}")


def device_arch(device: torch.device) -> str:
    """The NVRTC architecture of `device`: "sm_90" for an H100. Does not mutate."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def _make_primary_context_current(driver: ModuleType, index: int) -> None:
    """Load modules into the device's primary context, the one torch's runtime calls use, so that
    kernels and torch share streams and memory. `torch.cuda.device` (cudaSetDevice) normally made it
    current already; otherwise retain and set it. Mutates the calling thread's current context."""
    torch.cuda.init()
    err, current = driver.cuCtxGetCurrent()
    _check(driver, err, "cuCtxGetCurrent")
    if int(current) != 0:
        return
    err, dev = driver.cuDeviceGet(index)
    _check(driver, err, f"cuDeviceGet({index})")
    err, primary = driver.cuDevicePrimaryCtxRetain(dev)
    _check(driver, err, f"cuDevicePrimaryCtxRetain({index})")
    (err,) = driver.cuCtxSetCurrent(primary)
    _check(driver, err, "cuCtxSetCurrent")


def _dependent_launch_config(driver: ModuleType) -> Any:
    """A `CUlaunchConfig` that makes a launch a programmatic dependent one; the caller fills in
    the grid, block, shared memory and stream per launch."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.attrs = [attribute]
    config.numAttrs = 1
    return config


class CudaKernel:
    """One `__global__` function of a loaded module, with its preallocated parameter block."""

    __slots__ = (
        "_dependent_config",
        "_driver",
        "_func",
        "_launch",
        "_lock",
        "_params",
        "_ptrs",
        "_slots",
        "_struct",
        "_success",
        "name",
    )

    def __init__(self, driver: ModuleType, func: Any, name: str, signature: str) -> None:
        """`signature` has one kind letter per kernel parameter, in order (see `_SLOT_FORMAT`)."""
        unknown = set(signature) - set(_SLOT_FORMAT)
        if unknown:
            raise ValueError(f"kernel {name}: unknown argument kinds {sorted(unknown)} in {signature!r}")
        self.name = name
        self._driver = driver
        self._func = func
        self._launch = driver.cuLaunchKernel
        self._success = driver.CUresult.CUDA_SUCCESS
        self._struct = struct.Struct("<" + "".join(_SLOT_FORMAT[k] for k in signature))
        self._slots = ctypes.create_string_buffer(8 * len(signature))
        base = ctypes.addressof(self._slots)
        self._ptrs = (ctypes.c_void_p * len(signature))(*(base + 8 * i for i in range(len(signature))))
        self._params = ctypes.addressof(self._ptrs)
        self._dependent_config: Any = None  # built at the first programmatic dependent launch
        self._lock = threading.Lock()  # the parameter block and launch configuration are shared

    def launch(
        self,
        grid: tuple[int, int, int],
        threads: int,
        shared_bytes: int,
        stream: int,
        *args: int | float,
    ) -> None:
        """Launch on `stream` (a raw `cudaStream_t`, e.g. `torch.cuda.current_stream().cuda_stream`).
        Asynchronous; mutates only the parameter block (copied by the driver before returning)."""
        with self._lock:
            self._struct.pack_into(self._slots, 0, *args)
            (err,) = self._launch(
                self._func, grid[0], grid[1], grid[2], threads, 1, 1, shared_bytes, stream, self._params, 0
            )
        if err != self._success:
            _check(self._driver, err, f"cuLaunchKernel({self.name}, grid={grid}, threads={threads})")

    def launch_dependent(
        self,
        grid: tuple[int, int, int],
        threads: int,
        shared_bytes: int,
        stream: int,
        *args: int | float,
    ) -> None:
        """`launch` as a programmatic dependent launch (sm_90+): the grid may start while the
        previous kernel on `stream` drains, so the kernel must have been compiled with DEPENDENT=1
        (its CTAs wait on the device before touching memory: `kernels/programmatic.cuh`).
        Asynchronous; mutates the parameter block and the kernel's launch configuration."""
        with self._lock:
            config = self._dependent_config
            if config is None:
                config = self._dependent_config = _dependent_launch_config(self._driver)
            config.gridDimX, config.gridDimY, config.gridDimZ = grid
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = shared_bytes
            config.hStream = stream
            self._struct.pack_into(self._slots, 0, *args)
            (err,) = self._driver.cuLaunchKernelEx(config, self._func, self._params, 0)
        if err != self._success:
            _check(self._driver, err, f"cuLaunchKernelEx({self.name}, grid={grid}, programmatic dependent)")


class KernelLoader:
    """Compiles (through the disk cache), loads and hands out kernels, once per source and device.
    Thread-safe; `kernel` mutates only the loader's caches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the dicts below
        self._modules: dict[tuple[KernelSource, int], Any] = {}  # (source, device index) -> CUmodule
        self._kernels: dict[tuple[KernelSource, int, str], CudaKernel] = {}
        # (source, device index) -> the lock held while that module compiles and loads: one lock
        # for all would make the start-up sweep's threads compile one module at a time
        self._module_locks: dict[tuple[KernelSource, int], threading.Lock] = {}

    def kernel(self, source: KernelSource, function: str, signature: str, device: torch.device) -> CudaKernel:
        """The `extern "C"` function `function` of `source` on `device`. The first call per source and
        device compiles or reads the cubin and loads it into the device's primary context."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (source, index, function)
        found = self._kernels.get(key)
        if found is not None:
            return found
        driver = load_driver()
        module = self._module(driver, source, index)
        with self._lock:
            found = self._kernels.get(key)
            if found is None:
                err, func = driver.cuModuleGetFunction(module, function.encode())
                _check(driver, err, f"cuModuleGetFunction({function} in {source.file})")
                found = CudaKernel(driver, func, function, signature)
                self._kernels[key] = found
        return found

    def _module(self, driver: ModuleType, source: KernelSource, index: int) -> Any:
        with self._lock:
            module = self._modules.get((source, index))
            lock = self._module_locks.setdefault((source, index), threading.Lock())
        if module is not None:
            return module
        with lock:  # this module only: others compile meanwhile
            module = self._modules.get((source, index))
            if module is None:
                device = torch.device("cuda", index)
                cubin = cached_cubin(source, device_arch(device))
                with torch.cuda.device(index):
                    _make_primary_context_current(driver, index)
                    err, module = driver.cuModuleLoadData(cubin)
                    _check(driver, err, f"cuModuleLoadData({source.file}, {dict(source.defines)})")
                with self._lock:
                    self._modules[(source, index)] = module
        return module


LOADER = KernelLoader()
"""The process's loader: modules are per process and per device, like torch's CUDA context."""
