"""Launch parameters of the Triton kernels (read from the plugin's tuned-config files), and
`CachedLaunch`, a launch whose arguments are fixed once per step.

The files in `configs/` follow the framework schema (`pagedserve.platforms.tuned_configs`): one file
per kernel and device key ("default", a family token like "h100", or an exact device name). This
module turns the loosely typed `params` into checked dataclasses and caches one answer per shape
class, so the hot path does a dict lookup and never autotunes. The offline sweep
`python benchmarks/kernel_benchmarks/attention.py --tune OUT_DIR` writes such files (see configs/README.md).

Shape keys passed to the lookup (every file's `match` may use any of them, exact or `_le`/`_ge`):
  attention kernels ("unified_attention_2d", "unified_attention_3d"):
      head_size, block_size, num_queries_per_kv, dtype ("float16", "bfloat16", "float32"),
      kv_cache_dtype (the cache's: `dtype`'s name, or "float8_e4m3fn" / "float8_e5m2"),
      max_query_len (rounded UP to a power of two, so write bounds as powers of two)
  cascade kernels ("cascade_prefix", "cascade_suffix", plugin API 1.16): the attention kernels' keys
  "merge_attention_states", "reduce_segments", "reshape_and_cache": head_size
  "copy_blocks": block_elems (block_size * num_kv_heads * head_size)

Params of the attention kernels: num_warps, num_stages, TILE_SIZE, BLOCK_M (required) and the
kernel variants (optional, default off): PREFETCH_BLOCK_IDS, LAZY_RESCALE (true/false),
LOOP_STAGES (integer >= 0, 0 = the kernel's num_stages), WARP_SPECIALIZE (true/false; honoured on
NVIDIA sm_90+ only), LONGEST_FIRST (true/false). `AttentionLaunchConfig` says what each does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.platforms.tuned_configs import Params, TunedConfigError, TunedConfigs
from pagedserve_triton.compile_keys import launch_variant

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_VALID_WARPS = (1, 2, 4, 8, 16)
_MIN_MAXNREG, _MAX_MAXNREG = 16, 255  # what NVIDIA's assembler accepts as registers per thread
RAGGED_PREFILL_KERNELS = ("triton", "gluon_sm90")
ParamValue = int | float | str | bool  # a value of `Params`


def tuned_config_files() -> list[Path]:
    """The plugin's tuned-config files, in a stable order. Does not read them."""
    return sorted(CONFIG_DIR.glob("*.json"))


@dataclass(frozen=True, slots=True)
class AttentionLaunchConfig:
    """Launch parameters of one unified-attention kernel for one shape class."""

    num_warps: int
    num_stages: int
    tile_size: int  # keys per step of the KV loop (power of two, >= 16)
    block_m: int  # query rows per tile: tokens x grouped query heads (power of two, >= 16)
    kv_cache_modifier: str = ""  # cache_modifier of the K/V loads: "" or ".cg"
    # Launch options of one Triton backend only (AMD's waves_per_eu, ...), already checked against
    # the backend the launch targets: (name, value) pairs passed beside num_warps and num_stages.
    backend_options: tuple[tuple[str, int], ...] = ()
    # Kernel variants (the interior, unmasked KV loop and the launch order); the defaults are
    # the plain loop in the plain order.
    prefetch_block_ids: bool = False  # load the next tile's block ids one iteration ahead
    lazy_rescale: bool = False  # rescale acc only when the running maximum grows by > 2**8
    loop_stages: int = 0  # the loop's own pipelining depth; 0: the kernel's num_stages
    warp_specialize: bool = False  # ask Triton to warp-specialise the loop (NVIDIA sm_90+ only)
    longest_first: bool = False  # launch query blocks in reverse: longest causal KV ranges first

    def variant_constexprs(self, *, warp_specialize_supported: bool) -> dict[str, bool | int]:
        """The kernels' variant constexprs for this config. `warp_specialize_supported` is
        whether the launch targets a GPU where Triton warp-specialises (`warp_specialize_supported`);
        elsewhere the flag is dropped and the loop keeps its other settings. Warp specialisation
        needs a `tl.range` loop, so it gets one with the kernel's num_stages when `loop_stages` is 0.
        Pure."""
        specialise = self.warp_specialize and warp_specialize_supported
        loop_stages = self.loop_stages or (self.num_stages if specialise else 0)
        return {
            "PREFETCH_BLOCK_IDS": self.prefetch_block_ids,
            "LAZY_RESCALE": self.lazy_rescale,
            "LOOP_STAGES": loop_stages,
            "WARP_SPECIALIZE": specialise,
            "LONGEST_FIRST": self.longest_first,
        }


@dataclass(frozen=True, slots=True)
class RaggedPrefillLaunchConfig:
    """Launch parameters of the ragged prefill kernel for one shape class."""

    num_warps: int
    num_stages: int
    block_m: int  # query rows per program: tokens of one query head (power of two >= 16)
    block_n: int  # keys per KV step (power of two >= 16, dividing block_m)
    prefetch_block_ids: bool = False  # cached-context loop: next tile's block ids one step ahead
    # Registers per thread the compiler may use (None: its own choice). Capping 8-warp programs at
    # 128 lets two of them share an SM's register file, so four warpgroups interleave there.
    maxnreg: int | None = None
    # Which kernel runs: "triton" (`ragged_prefill.py`) or "gluon_sm90" (`ragged_prefill_sm90.py`,
    # whole prompts on sm_90 GPUs; elsewhere the Triton kernel runs with the same tile sizes).
    kernel: str = "triton"


@dataclass(frozen=True, slots=True)
class SimpleLaunchConfig:
    """Launch parameters of the reduction and cache kernels."""

    num_warps: int
    block: int  # elements a program moves per step (copy kernels); 0 where unused


def _int_param(params: Params, name: str, where: str, *, power_of_two_ge: int | None = None) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TunedConfigError(f"{where}: param {name!r} must be an integer, got {value!r}")
    if power_of_two_ge is not None and (value < power_of_two_ge or value & (value - 1)):
        raise TunedConfigError(f"{where}: param {name!r}={value} must be a power of two >= {power_of_two_ge}")
    return value


def _warps(params: Params, where: str) -> int:
    warps = _int_param(params, "num_warps", where)
    if warps not in _VALID_WARPS:
        raise TunedConfigError(f"{where}: num_warps={warps} must be one of {_VALID_WARPS}")
    return warps


def _maxnreg(params: Params, where: str) -> int | None:
    """The optional "maxnreg" param: a register cap per thread the hardware can honour."""
    if "maxnreg" not in params:
        return None
    value = _int_param(params, "maxnreg", where)
    if not _MIN_MAXNREG <= value <= _MAX_MAXNREG:
        bounds = f"[{_MIN_MAXNREG}, {_MAX_MAXNREG}]"
        raise TunedConfigError(f"{where}: param 'maxnreg'={value} must be in {bounds}")
    return value


def _kernel_param(params: Params, where: str) -> str:
    """The optional "KERNEL" param of "ragged_prefill": one of `RAGGED_PREFILL_KERNELS`."""
    value = params.get("KERNEL", "triton")
    if value not in RAGGED_PREFILL_KERNELS:
        raise TunedConfigError(f"{where}: param 'KERNEL'={value!r} must be one of {RAGGED_PREFILL_KERNELS}")
    return str(value)


def _check_gluon_sm90(config: RaggedPrefillLaunchConfig, where: str, *, has_context: bool) -> None:
    """What the Gluon kernel's entries must say: its fixed tile shape, and no cached context."""
    if has_context:
        raise TunedConfigError(
            f"{where}: KERNEL 'gluon_sm90' reads no cached context; match has_context=false only"
        )
    # `ragged_prefill_sm90.BLOCK_M` and `NUM_WARPS`, restated: this module loads without Triton.
    shape = (64, 4)
    if (config.block_m, config.num_warps) != shape or config.num_stages < 2 or config.maxnreg is not None:
        raise TunedConfigError(
            f"{where}: KERNEL 'gluon_sm90' runs BLOCK_M={shape[0]} on {shape[1]} warps with num_stages >= 2 "
            f"and no maxnreg; got BLOCK_M={config.block_m}, num_warps={config.num_warps}, "
            f"num_stages={config.num_stages}, maxnreg={config.maxnreg}"
        )


def bool_param(params: Mapping[str, ParamValue], name: str, where: str) -> bool:
    """Optional param `name` of a tuned-config entry: true or false, false when absent."""
    value = params.get(name, False)
    if not isinstance(value, bool):
        raise TunedConfigError(f"{where}: param {name!r} must be true or false, got {value!r}")
    return value


def power_of_two_param(params: Mapping[str, ParamValue], name: str, where: str, least: int) -> int:
    """Param `name` of a tuned-config entry: a power of two of at least `least`."""
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
        raise TunedConfigError(f"{where}: param {name!r} must be a power of two >= {least}, got {value!r}")
    return value


def positive_param(params: Mapping[str, ParamValue], name: str, where: str) -> int:
    """Param `name` of a tuned-config entry: an integer of at least 1."""
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TunedConfigError(f"{where}: param {name!r} must be a positive integer, got {value!r}")
    return value


@functools.cache
def warp_specialize_supported(device: torch.device) -> bool:
    """Whether `WARP_SPECIALIZE` may be set for launches on `device`: an NVIDIA GPU of compute
    capability 9.0 or newer (Triton's warp specialisation targets Hopper and Blackwell); never
    on ROCm or under the interpreter. Cached per device."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def dtype_key(dtype: torch.dtype) -> str:
    """The `dtype` / `kv_cache_dtype` shape key: "bfloat16", "float8_e4m3fn", .... Pure."""
    return str(dtype).removeprefix("torch.")


class LaunchParams:
    """Tuned launch parameters by kernel, device and shape class, each looked up once and cached.

    `lookup` mutates only the private cache; answers never change for a given key."""

    def __init__(self, configs: TunedConfigs | None = None) -> None:
        self._configs = configs if configs is not None else TunedConfigs.from_files(tuned_config_files())
        self._attention: dict[tuple[str, str, int, int, int, str, str, int], AttentionLaunchConfig] = {}
        self._simple: dict[tuple[str, str, tuple[tuple[str, int], ...]], SimpleLaunchConfig] = {}
        self._ragged: dict[tuple[str, int, str, bool, int], RaggedPrefillLaunchConfig] = {}

    def attention(
        self,
        kernel: str,
        device_name: str,
        *,
        head_size: int,
        block_size: int,
        num_queries_per_kv: int,
        dtype: torch.dtype,
        max_query_len: int,
        kv_cache_dtype: torch.dtype | None = None,  # None: the cache holds `dtype`
    ) -> AttentionLaunchConfig:
        """Params of "unified_attention_2d" or "unified_attention_3d" for this shape class."""
        query_bucket = 1 << (max(max_query_len, 1) - 1).bit_length()  # next power of two
        kv_key = dtype_key(kv_cache_dtype if kv_cache_dtype is not None else dtype)
        dtypes = (dtype_key(dtype), kv_key)
        key = (kernel, device_name, head_size, block_size, num_queries_per_kv, *dtypes, query_bucket)
        cached = self._attention.get(key)
        if cached is not None:
            return cached
        shape: dict[str, int | str | bool] = {
            "head_size": head_size,
            "block_size": block_size,
            "num_queries_per_kv": num_queries_per_kv,
            "dtype": dtype_key(dtype),
            "kv_cache_dtype": kv_key,
            "max_query_len": query_bucket,
        }
        params = self._configs.lookup(kernel, device_name, **shape)
        where = f"tuned config of {kernel!r} on {device_name!r} for {shape}"
        config = AttentionLaunchConfig(
            num_warps=_warps(params, where),
            num_stages=_int_param(params, "num_stages", where),
            tile_size=_int_param(params, "TILE_SIZE", where, power_of_two_ge=16),
            block_m=_int_param(params, "BLOCK_M", where, power_of_two_ge=16),
            prefetch_block_ids=bool_param(params, "PREFETCH_BLOCK_IDS", where),
            lazy_rescale=bool_param(params, "LAZY_RESCALE", where),
            loop_stages=_int_param(params, "LOOP_STAGES", where) if "LOOP_STAGES" in params else 0,
            warp_specialize=bool_param(params, "WARP_SPECIALIZE", where),
            longest_first=bool_param(params, "LONGEST_FIRST", where),
        )
        if config.loop_stages < 0:
            raise TunedConfigError(f"{where}: param 'LOOP_STAGES' must be >= 0, got {config.loop_stages}")
        self._attention[key] = config
        return config

    def ragged_prefill(
        self, device_name: str, *, head_size: int, dtype: torch.dtype, has_context: bool, max_query_len: int
    ) -> RaggedPrefillLaunchConfig:
        """Params of "ragged_prefill" for this shape class (`has_context`: some request of the
        batch has cached context before its new tokens; `max_query_len` is looked up rounded up
        to a power of two)."""
        query_bucket = 1 << (max(max_query_len, 1) - 1).bit_length()
        key = (device_name, head_size, dtype_key(dtype), has_context, query_bucket)
        cached = self._ragged.get(key)
        if cached is not None:
            return cached
        shape: dict[str, int | str | bool] = {
            "head_size": head_size,
            "dtype": dtype_key(dtype),
            "has_context": has_context,
            "max_query_len": query_bucket,
        }
        params = self._configs.lookup("ragged_prefill", device_name, **shape)
        where = f"tuned config of 'ragged_prefill' on {device_name!r} for {shape}"
        config = RaggedPrefillLaunchConfig(
            num_warps=_warps(params, where),
            num_stages=_int_param(params, "num_stages", where),
            block_m=_int_param(params, "BLOCK_M", where, power_of_two_ge=16),
            block_n=_int_param(params, "BLOCK_N", where, power_of_two_ge=16),
            prefetch_block_ids=bool_param(params, "PREFETCH_BLOCK_IDS", where),
            maxnreg=_maxnreg(params, where),
            kernel=_kernel_param(params, where),
        )
        if config.block_m % config.block_n:
            raise TunedConfigError(f"{where}: BLOCK_N={config.block_n} must divide BLOCK_M={config.block_m}")
        if config.kernel == "gluon_sm90":
            _check_gluon_sm90(config, where, has_context=has_context)
        self._ragged[key] = config
        return config

    def simple(self, kernel: str, device_name: str, **shape: int) -> SimpleLaunchConfig:
        """Params of a reduction or cache kernel ("reduce_segments", "reshape_and_cache",
        "copy_blocks"); `block` is read only where the file gives "BLOCK"."""
        key = (kernel, device_name, tuple(sorted(shape.items())))
        cached = self._simple.get(key)
        if cached is not None:
            return cached
        params = self._configs.lookup(kernel, device_name, **shape)
        where = f"tuned config of {kernel!r} on {device_name!r} for {shape}"
        block = _int_param(params, "BLOCK", where, power_of_two_ge=16) if "BLOCK" in params else 0
        config = SimpleLaunchConfig(num_warps=_warps(params, where), block=block)
        self._simple[key] = config
        return config


@functools.cache
def device_name_of(device: torch.device) -> str:
    """The name tuned configs are keyed by: the GPU's marketing name, or "cpu" (interpreter runs
    on CPU tensors fall back to the "default" files). Cached: the hot path asks on every call."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


@functools.cache
def _fast_launch_support() -> tuple[Callable[[int], int], Callable[[], int], Any] | None:
    """(get_current_stream, get_current_device, knobs.runtime) of the active Triton driver, or None
    where the compiled-kernel launch path is not available (a Triton without `knobs`, before 3.4, or
    a driver without these calls). Asked only after a launch returned a compiled kernel, so never
    under the interpreter. Cached: the answer is fixed for the process."""
    try:
        # Imported here, not at the top: the plugin module imports this file, and a machine
        # without triton must still discover the platform (as unavailable, with the reason).
        import triton
        from triton import knobs

        active = triton.runtime.driver.active
        return active.get_current_stream, active.get_current_device, knobs.runtime
    except (ImportError, AttributeError, RuntimeError):
        return None


@functools.cache
def _parameter_index(kernel: Any) -> dict[str, int]:
    """Parameter name -> position of a jit function. Cached per kernel (kernels live as long as
    their modules)."""
    return {name: i for i, name in enumerate(kernel.arg_names)}


def _is_compiled_kernel(obj: object) -> bool:
    """Whether `kernel[grid](...)` handed back a loaded compiled kernel (Triton 3.x `CompiledKernel`
    after a launch), and not None (the interpreter) or a pending async compile."""
    return (
        obj is not None
        and not hasattr(obj, "result")
        and all(hasattr(obj, name) for name in ("run", "function", "packed_metadata", "launch_metadata"))
        and getattr(obj, "function", None) is not None
    )


class CachedLaunch:
    """One kernel launch whose grid, scalars, constexprs and options are fixed when it is built
    (once per step) and whose per-call tensors fill `per_call` argument positions.

    Why. `kernel[grid](**kwargs)` binds every argument, computes the specialization key (type and
    16-byte alignment of each pointer, value class of each integer) and looks the compiled kernel up:
    tens of microseconds of Python per launch, paid by every layer. Here the first call launches the
    ordinary way and keeps the compiled kernel it returns; later calls whose per-call tensors have the
    same alignment as that first call's launch the compiled kernel directly (Triton's own last step,
    `CompiledKernel.run`), on the current stream. Everything else the specialization depends on is in
    the fixed arguments, and the owner rebuilds the launch when any of it changes (a new step or a
    new layout). Launch hooks (`triton.knobs.runtime.launch_enter_hook`, profilers) are read on every
    call and passed on as Triton does. Where the direct path is unavailable (the interpreter, a
    Triton before 3.4, a pending async compile) every call takes the ordinary path.

    Arguments are passed positionally in the kernel's parameter order, built from names once, so a
    renamed or missing kernel parameter fails at build time with the name. Calls mutate only the
    cached compiled kernel; the kernel writes whatever its output tensors are."""

    __slots__ = (
        "_aligned",
        "_args",
        "_compiled",
        "_device",
        "_grid",
        "_kernel",
        "_options",
        "_per_call",
        "_support",
    )

    def __init__(
        self,
        kernel: Any,  # a triton.jit function (JITFunction or InterpretedFunction)
        grid: tuple[int, ...],
        args: dict[str, object],  # every kernel parameter by name; per-call ones' values are overwritten
        per_call: Sequence[str],  # the parameters given by each call, in call order
        options: dict[str, int],  # launch options: num_warps, num_stages
    ) -> None:
        index = _parameter_index(kernel)
        if len(args) != len(index) or any(name not in index for name in args):
            missing = [name for name in index if name not in args]
            unknown = [name for name in args if name not in index]
            raise ValueError(
                f"launch of {kernel.__name__}: missing arguments {missing}, unknown arguments {unknown}"
            )
        self._kernel = kernel
        self._grid = (*grid, *(1,) * (3 - len(grid)))
        self._args: list[object] = [None] * len(index)
        for name, value in args.items():
            self._args[index[name]] = value
        self._per_call = tuple(index[name] for name in per_call)
        self._options = options
        self._compiled: Any = None
        self._aligned: tuple[bool, ...] = ()
        self._device = -1
        self._support: tuple[Callable[[int], int], Callable[[], int], Any] | None = None

    def variant(self, *tensors: object) -> Hashable | None:
        """The compiled variant a call with `tensors` launches (`compile_keys.launch_variant`), or
        None where this Triton cannot say. Host-only; launches nothing. Pure."""
        args = self._args.copy()
        for index, tensor in zip(self._per_call, tensors, strict=True):
            args[index] = tensor
        return launch_variant(self._kernel, args, self._options)

    @property
    def fast(self) -> bool:
        """Whether the next call with equally aligned tensors skips Triton's binder. Pure."""
        return self._compiled is not None

    def __call__(self, *tensors: torch.Tensor) -> None:
        """Launch with `tensors` in the `per_call` positions. Mutates the kernel's outputs."""
        args = self._args.copy()  # a copy: holding the tensors would keep them alive past the call
        for index, tensor in zip(self._per_call, tensors, strict=True):
            args[index] = tensor
        # Triton specializes pointer arguments on 16-byte alignment: a differently aligned tensor
        # needs a different compiled kernel, which only the ordinary path can pick.
        aligned = tuple(t.data_ptr() % 16 == 0 for t in tensors)
        compiled, support = self._compiled, self._support
        if compiled is not None and support is not None and aligned == self._aligned:
            get_stream, get_device, runtime = support
            device = get_device()
            enter_hook, exit_hook = runtime.launch_enter_hook, runtime.launch_exit_hook
            if device == self._device:
                grid = self._grid
                stream = get_stream(device)
                metadata = compiled.launch_metadata(grid, stream, *args) if enter_hook is not None else None
                compiled.run(
                    grid[0],
                    grid[1],
                    grid[2],
                    stream,
                    compiled.function,
                    compiled.packed_metadata,
                    metadata,
                    enter_hook,
                    exit_hook,
                    *args,
                )
                return
        result = self._kernel[self._grid](*args, **self._options)
        support = _fast_launch_support() if _is_compiled_kernel(result) else None
        if support is not None:
            self._compiled, self._support, self._aligned = result, support, aligned
            self._device = support[1]()
        else:
            self._compiled = None
