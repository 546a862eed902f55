"""`RocmUnifiedAttentionBackend`: the Triton unified attention kernels, launched the AMD way.

What is AMD's: the architecture's tables (tile sizes, warps, `waves_per_eu`, `matrix_instr_nonkdim`,
the K/V cache modifier), the XCD grid order and the platform's own 2D/3D thresholds.

One kernel source serves both vendors; this backend only chooses how it is launched. The target
of a device is resolved once (`RocmTarget`): on an AMD GPU its gcnArchName and CU count; anywhere
else (CPU test mode under `TRITON_INTERPRET=1`, or the verification mode on an NVIDIA GPU) the
assumed architecture's largest part, with every AMD-only launch option stripped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import torch

from pagedserve.platforms.api import IDENTITY_GRID_ORDER, AttentionCapabilities, GridOrder, UnsupportedCase
from pagedserve.platforms.tuned_configs import TunedConfigs
from pagedserve_rocm.arch import (
    ARCH_ENV,
    KNOWN_ARCHES,
    assumed_arch,
    base_arch,
    table_key,
    xcd_count,
    xcd_grid_order,
)
from pagedserve_rocm.launch_options import LaunchBackend
from pagedserve_rocm.tuning import RocmAttentionConfig, SplitThresholds, attention_config, split_thresholds
from pagedserve_rocm.tuning import tuned_config_files as rocm_config_files
from pagedserve_triton.attention import SplitPlan, TritonUnifiedAttentionBackend, choose_split
from pagedserve_triton.capabilities import UNIFIED_ATTENTION_CAPABILITIES
from pagedserve_triton.launch_params import AttentionLaunchConfig

if TYPE_CHECKING:  # the CLI defines the query type; the backend only reads its fields
    from pagedserve.cli.platforms import BatchQuery

INTERPRETER_CUS = 1  # as the Triton backend: interpreted runs take the 2D kernel unless forced
DISABLE_ENV = "PAGEDSERVE_ROCM_DISABLE"
SWITCHES = ("xcd_order", "kv_cache_modifier")  # what DISABLE_ENV may switch off


@dataclass(frozen=True, slots=True)
class RocmTarget:
    """What the launches on one device depend on."""

    device_name: str  # "AMD Instinct MI300X", or the part assumed for the architecture
    arch: str  # "gfx942"
    table: str  # device key of the tables: the arch, or "default" (generic AMD table)
    num_cus: int  # compute units the 2D/3D choice fills
    grid_order: GridOrder
    launch_backend: LaunchBackend  # which Triton backend compiles the launches
    notes: tuple[str, ...]  # why the target is what it is, for `--explain` and errors

    @staticmethod
    def for_arch(
        arch: str,
        device_name: str,
        num_cus: int,
        backend: LaunchBackend,
        notes: list[str],
        device_arch: str | None = None,
    ) -> RocmTarget:
        """The target of a device with `num_cus` CUs running `arch`'s tables; its XCDs are those of
        `device_arch` (default `arch`). `notes` come first in the target's notes. Pure."""
        notes = list(notes)
        table = table_key(arch)
        if table != arch:
            notes.append(f"no tables for {arch}: the generic AMD table ({table!r}) applies")
        layout = device_arch or arch
        _xcds, why = xcd_count(layout, num_cus)
        notes.append(why)
        order = xcd_grid_order(layout, num_cus)
        return RocmTarget(device_name, arch, table, num_cus, order, backend, tuple(notes))


def _assumed_target(backend: LaunchBackend, why: str, arch: str | None = None) -> RocmTarget:
    """The target where no AMD GPU is present: `arch` (else the assumed one) on its largest part."""
    arch = base_arch(arch) if arch else assumed_arch()
    known = KNOWN_ARCHES.get(arch)
    name, cus = (known.flagship, known.flagship_cus) if known is not None else (f"AMD {arch}", 1)
    return RocmTarget.for_arch(arch, name, cus, backend, [why, f"assumed {name} ({cus} CUs)"])


def resolve_target(device: torch.device, arch_override: str | None = None) -> RocmTarget:
    """The target of `device`: an AMD GPU's own architecture (or `arch_override`); elsewhere the
    assumed architecture. Reads device properties and the environment."""
    if device.type == "cuda" and torch.version.hip is not None:
        props = torch.cuda.get_device_properties(device)
        detected = base_arch(getattr(props, "gcnArchName", "unknown"))
        notes = [f"{props.name} is {detected}"]
        arch = detected
        if arch_override and base_arch(arch_override) != detected:
            arch = base_arch(arch_override)
            notes.append(f"tables of {arch} requested instead")
        return RocmTarget.for_arch(arch, props.name, props.multi_processor_count, "hip", notes, detected)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        why = f"verification mode on {name}: AMD tables through Triton's CUDA backend, AMD-only options off"
        return _assumed_target("cuda", why, arch_override)
    return _assumed_target("interpreter", "CPU test mode (TRITON_INTERPRET=1)", arch_override)


class RocmUnifiedAttentionBackend(TritonUnifiedAttentionBackend):
    """Unified paged attention for V1 batches on AMD Instinct GPUs (Triton's AMD backend)."""

    name: ClassVar[str] = "rocm_unified"
    # API 1.16: cascade steps on the Triton plugin's cascade kernels (compiled for gfx942/gfx950
    # in tests/test_triton_cascade_compile.py), with its default tables.
    capabilities: ClassVar[AttentionCapabilities] = replace(
        UNIFIED_ATTENTION_CAPABILITIES, cascade_attention=True
    )

    def __init__(
        self,
        *,
        tuned_configs: TunedConfigs | None = None,
        arch: str | None = None,
        num_splits: int | None = None,
        xcd_order: bool | None = None,
        kv_cache_modifier: bool | None = None,
    ) -> None:
        """`tuned_configs` is the platform's (`LoadedPlatform.tuned_configs()`); None reads this
        plugin's tables and the Triton plugin's. `arch` uses that architecture's tables and grid
        order whatever the device (default: the device's, or `PAGEDSERVE_ROCM_ARCH`). `num_splits`
        forces the 2D (1) or 3D kernel, as in the Triton backend. `xcd_order=False` launches in the
        identity order and `kv_cache_modifier=False` drops the tables' `.cg` (debugging, A/B
        timings); None reads `PAGEDSERVE_ROCM_DISABLE` ("xcd_order", "kv_cache_modifier", comma
        separated), so an engine's backend can be switched too."""
        configs = tuned_configs if tuned_configs is not None else TunedConfigs.from_files(rocm_config_files())
        super().__init__(tuned_configs=configs, num_splits=num_splits)
        disabled = {word.strip() for word in os.environ.get(DISABLE_ENV, "").split(",") if word.strip()}
        unknown = disabled - set(SWITCHES)
        if unknown:
            raise ValueError(
                f"{DISABLE_ENV}={os.environ[DISABLE_ENV]!r}: unknown {sorted(unknown)}; known: {SWITCHES}"
            )
        self._xcd_order = xcd_order if xcd_order is not None else "xcd_order" not in disabled
        self._kv_cache_modifier = (
            kv_cache_modifier if kv_cache_modifier is not None else "kv_cache_modifier" not in disabled
        )
        self._configs = configs
        self._arch = arch
        self._targets: dict[torch.device, RocmTarget] = {}
        self._rocm_configs: dict[tuple[object, ...], tuple[RocmAttentionConfig, AttentionLaunchConfig]] = {}

    @property
    def xcd_order(self) -> bool:
        """Whether launches use the XCD grid order (the constructor's or the environment's switch)."""
        return self._xcd_order

    def target(self, device: torch.device) -> RocmTarget:
        """The device's target, resolved once per device."""
        target = self._targets.get(device)
        if target is None:
            target = resolve_target(device, self._arch or os.environ.get(ARCH_ENV))
            self._targets[device] = target
        return target

    def rocm_config(
        self, kernel: str, target: RocmTarget, **shape: int | torch.dtype
    ) -> tuple[RocmAttentionConfig, AttentionLaunchConfig]:
        """(the table's config, the launch config for the target's backend), cached per shape class."""
        key = (
            kernel,
            target.table,
            target.launch_backend,
            tuple(sorted(shape.items(), key=lambda kv: kv[0])),
        )
        found = self._rocm_configs.get(key)
        if found is None:
            config = attention_config(self._configs, target.table, kernel, **shape)  # type: ignore[arg-type]
            if not self._kv_cache_modifier:
                config = replace(config, kv_cache_modifier="")
            found = (config, config.for_backend(target.launch_backend)[0])
            self._rocm_configs[key] = found
        return found

    def attention_config(
        self,
        kernel: str,
        device: torch.device,
        *,
        head_size: int,
        block_size: int,
        num_queries_per_kv: int,
        dtype: torch.dtype,
        max_query_len: int,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> AttentionLaunchConfig:
        """The architecture table's config, with the AMD-only options the launch cannot take removed.
        The tables hold one config per shape class whatever the cache's dtype (`kv_cache_dtype` is
        not looked at)."""
        return self.rocm_config(
            kernel,
            self.target(device),
            head_size=head_size,
            block_size=block_size,
            num_queries_per_kv=num_queries_per_kv,
            dtype=dtype,
            max_query_len=max_query_len,
        )[1]

    def grid_groups(self, device: torch.device) -> int:
        """One group per XCD of the device (of the assumed part elsewhere); 1 when switched off."""
        return self.target(device).grid_order.num_groups if self._xcd_order else 1

    def thresholds(self, target: RocmTarget) -> SplitThresholds:
        """The table's 2D/3D thresholds. Does not mutate."""
        return split_thresholds(self._configs, target.table)

    def split_plan(
        self,
        num_reqs: int,
        max_query_len: int,
        max_seq_len: int,
        num_kv_heads: int,
        device: torch.device,
        *,
        block_q: int,
        tile_size: int,
    ) -> SplitPlan:
        """`choose_split` with the table's thresholds and the target's CU count."""
        target = self.target(device)
        cus = INTERPRETER_CUS if target.launch_backend == "interpreter" else target.num_cus
        return _plan(
            self.thresholds(target),
            num_reqs,
            max_query_len,
            max_seq_len,
            num_kv_heads,
            cus,
            block_q,
            tile_size,
        )

    def explain_batch(self, batch: BatchQuery) -> str:
        """What `pagedserve platforms --explain` prints: kernel, config, grid order and why, on the
        batch's AMD device, or on the largest part of `batch.arch` (else the assumed architecture)
        when the batch's device is not an AMD GPU. Host-only; reads the tables."""
        try:
            self.check_supported(
                head_size=batch.head_size,
                dtype=batch.dtype,
                block_size=batch.block_size,
                sliding_window=batch.sliding_window,
                logit_softcap=batch.logit_softcap,
            )
        except UnsupportedCase as e:
            return f"unsupported: {e}"
        arch = batch.arch
        if "amd" in batch.device_name.lower():  # this AMD GPU, or one named by --device
            chosen = base_arch(arch) if arch else assumed_arch()
            notes = [] if arch else [f"architecture not given: {chosen} assumed (--arch to choose)"]
            target = RocmTarget.for_arch(chosen, batch.device_name, batch.num_sms, "hip", notes)
        else:
            why = (
                f"--arch {arch}"
                if arch
                else f"no AMD device named: {assumed_arch()} assumed (--arch to choose)"
            )
            target = _assumed_target("hip", why, arch)
        return explain(self, batch, target)


def _plan(
    t: SplitThresholds,
    num_reqs: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    num_cus: int,
    block_q: int,
    tile_size: int,
) -> SplitPlan:
    return choose_split(
        num_reqs,
        max_query_len,
        max_seq_len,
        num_kv_heads,
        num_cus,
        block_q=block_q,
        tile_size=tile_size,
        max_query_len_3d=t.max_query_len_3d,
        min_keys_per_split=t.min_keys_per_split,
        max_splits=t.max_splits,
        target_programs_per_sm=t.target_programs_per_cu,
    )


def explain(backend: RocmUnifiedAttentionBackend, batch: BatchQuery, target: RocmTarget) -> str:
    """The `--explain` text for `batch` on `target`: the kernel and why, its config, the grid order.
    Host-only; reads the tables through `backend`."""
    qpkv = batch.num_q_heads // batch.num_kv_heads
    shape: dict[str, int | torch.dtype] = dict(
        head_size=batch.head_size,
        block_size=batch.block_size,
        num_queries_per_kv=qpkv,
        dtype=batch.dtype,
        max_query_len=batch.max_query_len,
    )
    cfg_2d, _ = backend.rocm_config("unified_attention_2d", target, **shape)
    cfg_3d, _ = backend.rocm_config("unified_attention_3d", target, **shape)
    block_m = max(cfg_2d.block_m, 1 << (qpkv - 1).bit_length())
    block_q = block_m // qpkv
    t = backend.thresholds(target)
    plan = _plan(
        t, batch.num_seqs, batch.max_query_len, batch.max_seq_len, batch.num_kv_heads, target.num_cus,
        block_q, cfg_3d.tile_size,
    )  # fmt: skip
    tiles = batch.num_seqs * -(-batch.max_query_len // block_q) * batch.num_kv_heads
    if plan.kind == "3d":
        kernel, config = f"unified_attention_3d ({plan.num_splits} splits)", cfg_3d
        why = (
            f"{tiles} tiles (sequences x query blocks x KV heads) for {target.num_cus} CUs: the KV range "
            f"is split for ~{t.target_programs_per_cu} programs per CU (at least {t.min_keys_per_split} keys "
            f"per split, at most {t.max_splits} splits)"
        )
    else:
        kernel, config = "unified_attention_2d", cfg_2d
        if batch.max_query_len > t.max_query_len_3d:
            why = f"queries up to {batch.max_query_len} tokens (> {t.max_query_len_3d}) are parallel"
        elif tiles >= target.num_cus:
            why = f"{tiles} tiles already give {target.num_cus} CUs one each"
        else:
            why = f"the context ({batch.max_seq_len}) is too short for {t.min_keys_per_split}-key splits"
    order = target.grid_order if backend.xcd_order else IDENTITY_GRID_ORDER
    grid = (
        f"grid order {order.name}: tiles of one (request, KV head) stay on one XCD's L2"
        if order.num_groups > 1
        else "grid order identity"
    )
    notes = "; ".join(target.notes)
    return (
        f"{kernel}: {why}\n  config ({target.table} table): {config.describe()}\n  {grid}\n"
        f"  target: {target.device_name}, {target.arch}, {target.num_cus} CUs ({notes})"
    )
