"""AMD GPU architectures the rocm platform knows: what a gcnArchName means, and how many XCDs a device has.

MI300X/MI325X (gfx942) and MI350X/MI355X (gfx950) are built from 8 XCDs (accelerator complex dies),
each with its own L2 cache. The hardware deals workgroups to the XCDs round-robin, so the XCD
count is what the grid order needs. It is derived from the device's CU count, not assumed: a GPU
partitioned into CPX mode shows one XCD's CUs (38 on MI300X) and gets the identity order, DPX
mode four XCDs, MI300A six, MI308X (20 CUs per XCD) four.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedserve.platforms.api import IDENTITY_GRID_ORDER, GridOrder

ARCH_ENV = "PAGEDSERVE_ROCM_ARCH"
"""Environment variable naming the architecture whose tables and grid order to use instead of the
device's (on an NVIDIA GPU it turns on the verification mode of `plugin.availability`)."""

DEFAULT_ASSUMED_ARCH = "gfx942"
"""The architecture assumed where no AMD GPU is present (CPU test mode, `--explain` without
`--arch`, the verification mode on NVIDIA) and `ARCH_ENV` is unset."""

GENERIC_TABLE = "default"
"""The device key of the generic AMD tables, used for architectures without tables of their own."""


@dataclass(frozen=True, slots=True)
class AmdArch:
    """One AMD Instinct architecture: what the tables and the grid order depend on."""

    name: str  # "gfx942"
    products: str  # "MI300X, MI325X"
    flagship: str  # the marketing name of its largest part, assumed when no device is present
    flagship_cus: int  # compute units of that part
    cus_per_xcd: tuple[int, ...]  # CUs per XCD of the parts built on it, most common first
    max_xcds: int  # XCDs of the largest part
    lds_bytes: int  # LDS (shared memory) per workgroup
    vgprs_per_simd: int = 512  # VGPRs (arch + accumulation) per SIMD lane, shared by its waves
    max_waves_per_eu: int = 8  # waves one SIMD (execution unit) can hold
    vgpr_granule: int = 8  # VGPRs are allocated in blocks of this many


KNOWN_ARCHES: dict[str, AmdArch] = {
    "gfx942": AmdArch(
        name="gfx942",
        products="MI300X, MI325X (also MI300A, MI308X)",
        flagship="AMD Instinct MI300X",
        flagship_cus=304,
        cus_per_xcd=(38, 20),  # 38 on MI300X/MI300A/MI325X, 20 on MI308X
        max_xcds=8,
        lds_bytes=64 * 1024,
    ),
    "gfx950": AmdArch(
        name="gfx950",
        products="MI350X, MI355X",
        flagship="AMD Instinct MI355X",
        flagship_cus=256,
        cus_per_xcd=(32,),
        max_xcds=8,
        lds_bytes=160 * 1024,
    ),
}


def base_arch(gcn_arch_name: str) -> str:
    """The architecture of a `gcnArchName`, without target features: "gfx942:sramecc+:xnack-" ->
    "gfx942". Pure."""
    return gcn_arch_name.split(":", 1)[0].strip().lower()


def table_key(arch: str) -> str:
    """The device key of the tuned tables for `arch`: the arch itself when it has tables, else
    `GENERIC_TABLE`. Pure."""
    return arch if arch in KNOWN_ARCHES else GENERIC_TABLE


def assumed_arch() -> str:
    """`ARCH_ENV` if set, else `DEFAULT_ASSUMED_ARCH`; for places without an AMD GPU. Reads the
    environment."""
    return base_arch(os.environ.get(ARCH_ENV) or DEFAULT_ASSUMED_ARCH)


def xcd_count(arch: str, num_cus: int) -> tuple[int, str]:
    """(XCDs, why) of a device of `arch` with `num_cus` CUs: the CU count split into whole XCDs of
    the architecture's size, at most its largest part's count. An unknown architecture or a CU
    count that does not split gets 1 (identity order), and the reason says so. Pure."""
    known = KNOWN_ARCHES.get(arch)
    if known is None:
        return 1, f"{arch} has no XCD layout in this plugin: identity order"
    for per_xcd in known.cus_per_xcd:
        if num_cus % per_xcd == 0 and 1 <= num_cus // per_xcd <= known.max_xcds:
            count = num_cus // per_xcd
            return count, f"{num_cus} CUs = {count} XCD{'s' if count > 1 else ''} of {per_xcd} CUs"
    sizes = " or ".join(str(n) for n in known.cus_per_xcd)
    return 1, f"{num_cus} CUs do not split into XCDs of {sizes} CUs on {arch}: identity order"


def xcd_grid_order(arch: str, num_cus: int) -> GridOrder:
    """The grid order of a device: one group per XCD (`GridOrder.remap` keeps each group's tiles
    contiguous, so neighbouring tiles share an XCD's L2), or the identity for one XCD. Pure."""
    count, _ = xcd_count(arch, num_cus)
    return IDENTITY_GRID_ORDER if count == 1 else GridOrder(name=f"xcd{count}", num_groups=count)


def waves_per_eu(arch: str, vgpr_count: int) -> int:
    """Waves one SIMD can hold with `vgpr_count` VGPRs per lane (arch + accumulation registers,
    rounded up to the allocation granule), capped at the hardware maximum. Pure."""
    known = KNOWN_ARCHES.get(arch, KNOWN_ARCHES[DEFAULT_ASSUMED_ARCH])
    allocated = max(known.vgpr_granule, -(-vgpr_count // known.vgpr_granule) * known.vgpr_granule)
    return min(known.max_waves_per_eu, known.vgprs_per_simd // allocated)
