"""Every attention kernel variant the rocm tables can select, compiled for gfx942 and gfx950 by
Triton's AMD backend (no GPU needed): zero VGPR and SGPR spills, at least the occupancy its
`waves_per_eu` asks for, LDS within the architecture's, and K/V loads carrying the cache-policy
bits of its cache modifier. Each table entry is compiled at its most demanding shape
(`amdgcn.table_variants`); the 3D kernel's reduction at the tables' largest split count. In a
process whose Triton kernels are interpreted (another test file set TRITON_INTERPRET=1 first), each
compilation runs in a child process without it."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.backends.amd.compiler")

from compile_child import run_without_interpreter

from pagedserve.platforms.tuned_configs import TunedConfigs
from pagedserve_rocm.amdgcn import (
    AmdgcnStats,
    TableVariant,
    carries_policy,
    compile_attention,
    compile_reduction,
    kv_load_bits,
    table_variants,
)
from pagedserve_rocm.arch import KNOWN_ARCHES
from pagedserve_rocm.tuning import split_thresholds, tuned_config_files

VARIANTS = [(arch, i, v) for arch in ("gfx942", "gfx950") for i, v in enumerate(table_variants(arch))]

# Kernels decorated while TRITON_INTERPRET=1 was set (another test module of this process set it
# before importing them) cannot be compiled; such a process compiles in a child without it.
_CHILD = """
import dataclasses, json, sys
from pagedserve_rocm.amdgcn import compile_attention, compile_reduction, table_variants
stats = eval(sys.argv[1])
fields = dataclasses.asdict(stats)
fields["kv_load_bits"] = [sorted(bits) for bits in stats.kv_load_bits]
print(json.dumps(fields))
"""


def _compiled(call: str) -> AmdgcnStats:
    """`call` (an expression over `compile_attention`, `compile_reduction`, `table_variants`)
    evaluated here, or in a child process where this one's kernels are interpreted."""
    from pagedserve_triton.interpreter import INTERPRETED

    if not INTERPRETED:
        found = eval(call, {"compile_attention": compile_attention, "compile_reduction": compile_reduction,
                            "table_variants": table_variants})  # fmt: skip
        assert isinstance(found, AmdgcnStats)
        return found
    fields = run_without_interpreter(_CHILD, call)
    fields["kv_load_bits"] = tuple(frozenset(bits) for bits in fields["kv_load_bits"])
    return AmdgcnStats(**fields)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "index", "table_variant"), VARIANTS, ids=[f"{a}:{v.entry}" for a, _, v in VARIANTS]
)
def test_table_variant_compiles_without_spills(arch: str, index: int, table_variant: TableVariant) -> None:
    variant = table_variant.variant
    stats = _compiled(f"compile_attention(table_variants({arch!r})[{index}].variant)")
    assert (stats.vgpr_spills, stats.sgpr_spills) == (0, 0), stats
    assert stats.waves_per_eu >= variant.config.waves_per_eu, stats
    assert stats.lds_bytes <= KNOWN_ARCHES[variant.arch].lds_bytes
    assert stats.kv_load_bits, "no K/V vector loads found in the assembly"
    modifier = variant.config.kv_cache_modifier
    assert all(carries_policy(bits, modifier) for bits in stats.kv_load_bits), (modifier, stats.kv_load_bits)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_reduction_at_the_largest_split_count_does_not_spill(arch: str) -> None:
    configs = TunedConfigs.from_files(tuned_config_files())
    splits = split_thresholds(configs, arch).max_splits
    warps = int(configs.lookup("reduce_segments", arch, head_size=256)["num_warps"])
    stats = _compiled(f"compile_reduction({arch!r}, head_size=256, num_splits={splits}, num_warps={warps})")
    assert (stats.vgpr_spills, stats.sgpr_spills) == (0, 0), stats


def test_every_table_entry_is_a_variant() -> None:
    assert len(VARIANTS) == sum(len(table_variants(arch)) for arch in KNOWN_ARCHES) >= 8
    assert {v.variant.config.kv_cache_modifier for _, _, v in VARIANTS} == {"", ".cg"}


def test_kv_load_bits_are_read_from_both_load_forms() -> None:
    asm = (
        "\tglobal_load_dwordx4 v[4:7], v[2:3], off nt\n"
        "\tglobal_load_lds_dwordx4 v[2:3], off sc0 sc1\n"
        "\tbuffer_load_dwordx4 v[8:11], v1, s[0:3], 0 offen\n"
        "\tglobal_load_dwordx4 v[4:7], v[2:3], off\n"
    )
    assert kv_load_bits(asm) == (frozenset({"nt"}), frozenset({"sc0", "sc1"}), frozenset())
    assert carries_policy(frozenset({"nt"}), ".cg") and carries_policy(frozenset({"nt", "sc0"}), ".cg")
    assert not carries_policy(frozenset(), ".cg") and not carries_policy(frozenset({"sc0", "sc1"}), ".cg")
    assert carries_policy(frozenset(), "") and not carries_policy(frozenset({"nt"}), "")
