"""The rocm platform without an AMD GPU: availability reasons, architecture and XCD detection, the
XCD grid order (a bijection for every grid size, and one XCD per (request, KV head)), the tables
and their checks, the launch-option rule between the two Triton backends, and `--explain`."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.platforms.api import GridOrder
from pagedserve.platforms.tuned_configs import TunedConfigError, TunedConfigs
from pagedserve_rocm import plugin
from pagedserve_rocm.arch import ARCH_ENV, base_arch, table_key, waves_per_eu, xcd_count, xcd_grid_order
from pagedserve_rocm.launch_options import AMD_ONLY_OPTIONS, NVIDIA_ONLY_OPTIONS, options_for
from pagedserve_rocm.tuning import (
    ATTENTION_KERNELS,
    attention_config,
    read_attention_config,
    split_thresholds,
    tuned_config_files,
)

# --- availability ------------------------------------------------------------------------------


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, *, hip: str | None, arch: str = "", cus: int = 304) -> None:
    props = types.SimpleNamespace(name="AMD Instinct MI300X", gcnArchName=arch, multi_processor_count=cus)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _=0: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _=0: "NVIDIA H100 80GB HBM3")


def test_unavailable_here_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ARCH_ENV, raising=False)
    monkeypatch.setattr(torch.version, "hip", None)
    result = plugin.availability()
    assert (
        not result.available and "not a ROCm build" in result.reason and "torch.version.hip" in result.reason
    )


def test_available_on_an_mi300x_names_arch_cus_and_xcds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ARCH_ENV, raising=False)
    _fake_gpu(monkeypatch, hip="6.4", arch="gfx942:sramecc+:xnack-")
    result = plugin.availability()
    assert result.available and "gfx942, 304 CUs, 8 XCDs" in result.reason


def test_an_unknown_arch_falls_back_to_the_generic_table_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ARCH_ENV, raising=False)
    _fake_gpu(monkeypatch, hip="6.4", arch="gfx90a:sramecc+:xnack-", cus=104)
    result = plugin.availability()
    assert (
        result.available and "no tables for gfx90a" in result.reason and "generic AMD table" in result.reason
    )


def test_no_amd_gpu_under_rocm_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no AMD GPU visible" in plugin.availability().reason


def test_nvidia_gpu_is_refused_unless_the_verification_mode_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_gpu(monkeypatch, hip=None)
    monkeypatch.delenv(ARCH_ENV, raising=False)
    assert not plugin.availability().available
    monkeypatch.setenv(ARCH_ENV, "gfx942")
    result = plugin.availability()
    assert (
        result.available
        and "verification mode" in result.reason
        and "AMD-only launch options stripped" in result.reason
    )


def test_grid_order_hook_answers_for_this_amd_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plugin.pagedserve_grid_order("rocm", "AMD Instinct MI300X") is None  # no AMD GPU here
    _fake_gpu(monkeypatch, hip="6.4", arch="gfx942:sramecc+:xnack-")
    assert plugin.pagedserve_grid_order("rocm", "AMD Instinct MI300X") == GridOrder("xcd8", 8)
    assert plugin.pagedserve_grid_order("rocm", "AMD Instinct MI210") is None
    assert plugin.pagedserve_grid_order("triton", "AMD Instinct MI300X") is None
    _fake_gpu(monkeypatch, hip="6.4", arch="gfx942:sramecc+:xnack-", cus=38)  # CPX partition
    assert plugin.pagedserve_grid_order("rocm", "AMD Instinct MI300X").num_groups == 1  # type: ignore[union-attr]


def test_priority_is_above_triton() -> None:
    import pagedserve_triton.plugin as triton_plugin

    (rocm,) = plugin.pagedserve_platforms()
    (triton,) = triton_plugin.pagedserve_platforms()
    assert rocm.priority > triton.priority


# --- architectures and XCDs ----------------------------------------------------------------------


def test_arch_names_and_tables() -> None:
    assert base_arch("gfx942:sramecc+:xnack-") == "gfx942" and base_arch("gfx950") == "gfx950"
    assert (
        table_key("gfx942") == "gfx942"
        and table_key("gfx950") == "gfx950"
        and table_key("gfx90a") == "default"
    )


@pytest.mark.parametrize(
    ("arch", "cus", "xcds"),
    [
        ("gfx942", 304, 8),  # MI300X, MI325X
        ("gfx942", 228, 6),  # MI300A
        ("gfx942", 80, 4),  # MI308X: 20 CUs per XCD
        ("gfx942", 152, 4),  # MI300X in DPX mode
        ("gfx942", 38, 1),  # MI300X in CPX mode: one XCD per device
        ("gfx950", 256, 8),  # MI350X, MI355X
        ("gfx950", 32, 1),
        ("gfx942", 300, 1),  # does not split: identity, said so
        ("gfx90a", 104, 1),
    ],
)
def test_xcds_come_from_the_cu_count(arch: str, cus: int, xcds: int) -> None:
    count, why = xcd_count(arch, cus)
    assert count == xcds and why
    order = xcd_grid_order(arch, cus)
    assert order.num_groups == xcds and (order.name == f"xcd{xcds}" or xcds == 1)


def test_waves_per_eu_from_vgprs() -> None:
    assert waves_per_eu("gfx942", 128) == 4 and waves_per_eu("gfx942", 129) == 3
    assert waves_per_eu("gfx942", 256) == 2 and waves_per_eu("gfx942", 257) == 1
    assert waves_per_eu("gfx942", 40) == 8  # the hardware's maximum


@given(num_groups=st.integers(1, 8), num_programs=st.integers(1, 5000))
def test_xcd_remap_is_a_bijection_for_every_grid(num_groups: int, num_programs: int) -> None:
    order = GridOrder("xcd", num_groups)
    tiles = [order.remap(pid, num_programs) for pid in range(num_programs)]
    assert sorted(tiles) == list(range(num_programs))


@given(
    num_reqs=st.integers(1, 40),
    num_kv_heads=st.sampled_from([1, 2, 4, 8]),
    splits=st.sampled_from([1, 2, 4, 8, 16, 32]),
)
def test_tiles_of_one_request_and_kv_head_share_an_xcd(num_reqs: int, num_kv_heads: int, splits: int) -> None:
    """A decode batch through the 3D kernel: the tiles of a (request, KV head) are its `splits`
    consecutive tile ids. The hardware gives program `pid` to XCD `pid % 8`; with the remap each
    (request, KV head) lands on one XCD (two where its run crosses a group's edge), without it on
    min(splits, 8) XCDs. (A grid of fewer than 8 pairs spreads over every XCD either way.)"""
    num_programs = num_reqs * num_kv_heads * splits  # one query block per request (decode)
    if num_reqs * num_kv_heads < 8:
        num_programs *= 8  # enough pairs for every XCD to hold whole ones
    order = GridOrder("xcd8", 8)
    xcds_of: dict[int, set[int]] = {}
    identity_xcds_of: dict[int, set[int]] = {}
    for pid in range(num_programs):
        pair = order.remap(pid, num_programs) // splits  # kv_head * num_q_blocks + q_block
        xcds_of.setdefault(pair, set()).add(pid % 8)
        identity_xcds_of.setdefault(pid // splits, set()).add(pid % 8)
    assert max(len(x) for x in xcds_of.values()) <= 2
    if num_programs % (8 * splits) == 0:  # the groups' edges fall between pairs
        assert all(len(x) == 1 for x in xcds_of.values())
    assert all(len(x) == min(splits, 8) for x in identity_xcds_of.values())


# --- launch options: never on the other backend -----------------------------------------------------


def test_vendor_option_sets_agree_with_triton() -> None:
    from triton.backends.amd.compiler import HIPOptions
    from triton.backends.nvidia.compiler import CUDAOptions

    hip, cuda = set(HIPOptions.__dataclass_fields__), set(CUDAOptions.__dataclass_fields__)
    assert hip - cuda >= AMD_ONLY_OPTIONS
    assert cuda - hip >= NVIDIA_ONLY_OPTIONS


def test_amd_options_are_stripped_on_cuda_and_nvidia_options_on_hip() -> None:
    amd = {"num_warps": 4, "waves_per_eu": 2, "matrix_instr_nonkdim": 16}
    assert options_for(amd, "hip") == (amd, ())
    assert options_for(amd, "cuda") == ({"num_warps": 4}, ("matrix_instr_nonkdim", "waves_per_eu"))
    assert options_for(amd, "interpreter")[0] == {"num_warps": 4}
    nvidia = {"num_warps": 4, "maxnreg": 128}
    assert options_for(nvidia, "hip") == ({"num_warps": 4}, ("maxnreg",))
    assert options_for(nvidia, "cuda") == (nvidia, ())


def test_an_amd_table_config_reaches_cuda_launches_without_its_amd_options() -> None:
    config = read_attention_config(
        {"num_warps": 4, "num_stages": 2, "BLOCK_M": 16, "TILE_SIZE": 32, "waves_per_eu": 2,
         "matrix_instr_nonkdim": 16, "KV_CACHE_MODIFIER": ".cg"},
        "test",
    )  # fmt: skip
    on_hip, stripped = config.for_backend("hip")
    assert dict(on_hip.backend_options) == {"waves_per_eu": 2, "matrix_instr_nonkdim": 16} and not stripped
    on_cuda, stripped = config.for_backend("cuda")
    assert on_cuda.backend_options == () and stripped == ("matrix_instr_nonkdim", "waves_per_eu")
    assert (on_cuda.block_m, on_cuda.tile_size, on_cuda.kv_cache_modifier) == (16, 32, ".cg")


@pytest.mark.parametrize(
    ("param", "value", "message"),
    [
        ("maxnreg", 128, "NVIDIA backend only"),
        ("BLOCK_N", 32, "unknown param"),
        ("KV_CACHE_MODIFIER", ".cs", "KV_CACHE_MODIFIER must be"),
        ("matrix_instr_nonkdim", 8, "16 or 32"),
        ("BLOCK_M", 24, "power of two"),
    ],
)
def test_rocm_tables_refuse_what_amd_cannot_take(param: str, value: object, message: str) -> None:
    params: dict[str, int | float | str | bool] = {
        "num_warps": 4,
        "num_stages": 2,
        "BLOCK_M": 16,
        "TILE_SIZE": 32,
    }
    params[param] = value  # type: ignore[assignment]
    with pytest.raises(TunedConfigError, match=message):
        read_attention_config(params, "test")


# --- the shipped tables --------------------------------------------------------------------------


@pytest.mark.parametrize("table", ["gfx942", "gfx950", "default"])
def test_every_shape_class_has_a_valid_config(table: str) -> None:
    configs = TunedConfigs.from_files(tuned_config_files())
    for kernel in ATTENTION_KERNELS:
        for head_size in (32, 64, 80, 128, 256):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                for max_query_len in (1, 3, 16, 17, 2048):
                    config = attention_config(
                        configs, table, kernel, head_size=head_size, block_size=16, num_queries_per_kv=4,
                        dtype=dtype, max_query_len=max_query_len,
                    )  # fmt: skip
                    # `.cg` streams K/V past the caches: only where no other program re-reads them.
                    assert config.kv_cache_modifier == (
                        ".cg" if max_query_len == 1 and table != "default" else ""
                    )
    thresholds = split_thresholds(configs, table)
    assert thresholds.max_splits >= 64
    # The generic AMD table is the rocm plugin's own, found before the Triton plugin's default file.
    decode = attention_config(
        configs, table, "unified_attention_2d", head_size=128, block_size=16, num_queries_per_kv=4,
        dtype=torch.bfloat16, max_query_len=1,
    )  # fmt: skip
    assert (decode.tile_size, decode.waves_per_eu > 0) == ((16, False) if table == "default" else (32, True))


def test_config_files_are_listed_with_the_triton_fallbacks() -> None:
    names = [Path(p).name for p in plugin.pagedserve_tuned_config_files("rocm") or []]
    assert "unified_attention_2d-gfx942.json" in names and "reduce_segments-default.json" in names
    assert plugin.pagedserve_tuned_config_files("triton") is None


# --- the backend's choices and --explain ------------------------------------------------------------


def test_backend_targets_the_assumed_arch_off_amd_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve_rocm.attention import RocmUnifiedAttentionBackend

    monkeypatch.delenv(ARCH_ENV, raising=False)
    target = RocmUnifiedAttentionBackend().target(torch.device("cpu"))
    assert (target.arch, target.table, target.launch_backend, target.grid_order.num_groups) == (
        "gfx942", "gfx942", "interpreter", 8,
    )  # fmt: skip
    monkeypatch.setenv(ARCH_ENV, "gfx950")
    assert RocmUnifiedAttentionBackend().target(torch.device("cpu")).table == "gfx950"
    assert RocmUnifiedAttentionBackend(arch="gfx90a").target(torch.device("cpu")).table == "default"


def test_cli_lists_rocm_as_unavailable_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve.cli import main as cli_main

    assert cli_main.main(["platforms"]) == 0
    text = capsys.readouterr().out
    assert "rocm  [NOT available:" in text and "rocm_unified" in text


def test_cli_explain_with_arch(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedserve.cli import main as cli_main

    args = ["platforms", "--explain", "--platform", "rocm", "--arch", "gfx942"]
    assert cli_main.main([*args, "--batch", "1x1x8192"]) == 0
    text = capsys.readouterr().out
    assert "unified_attention_3d (128 splits)" in text and "gfx942 table" in text and "waves_per_eu 2" in text
    assert "grid order xcd8" in text and "AMD Instinct MI300X, gfx942, 304 CUs" in text
    assert cli_main.main([*args, "--batch", "256x1x2048"]) == 0
    assert "unified_attention_2d: 2048 tiles already give 304 CUs" in capsys.readouterr().out
    assert (
        cli_main.main(
            ["platforms", "--explain", "--platform", "rocm", "--arch", "gfx950", "--batch", "8x512x512"]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "BLOCK_M 64, TILE_SIZE 16" in text and "MI355X, gfx950, 256 CUs" in text
    on_partition = ["--device", "AMD Instinct MI300X:38:9.4", "--batch", "1x1x4096"]
    assert cli_main.main([*args, *on_partition]) == 0
    assert "grid order identity" in capsys.readouterr().out


@pytest.mark.parametrize(("hip", "kept"), [("6.4", True), (None, False)])
def test_backend_passes_amd_options_only_to_hip_launches(
    monkeypatch: pytest.MonkeyPatch, hip: str | None, kept: bool
) -> None:
    from pagedserve_rocm.attention import RocmUnifiedAttentionBackend

    monkeypatch.delenv(ARCH_ENV, raising=False)
    _fake_gpu(monkeypatch, hip=hip, arch="gfx942:sramecc+:xnack-")
    backend = RocmUnifiedAttentionBackend(arch=None if hip else "gfx942")
    device = torch.device("cuda", 0)
    target = backend.target(device)
    assert target.launch_backend == ("hip" if hip else "cuda") and target.grid_order.num_groups == 8
    config = backend.attention_config(
        "unified_attention_2d", device, head_size=128, block_size=16, num_queries_per_kv=4,
        dtype=torch.bfloat16, max_query_len=1,
    )  # fmt: skip
    assert (config.block_m, config.tile_size, config.kv_cache_modifier) == (16, 32, ".cg")
    expected = {"matrix_instr_nonkdim": 16, "waves_per_eu": 2} if kept else {}
    assert dict(config.backend_options) == expected


def test_xcd_order_and_cache_modifier_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve_rocm.attention import DISABLE_ENV, RocmUnifiedAttentionBackend

    monkeypatch.delenv(ARCH_ENV, raising=False)
    cpu = torch.device("cpu")
    shape = dict(head_size=128, block_size=16, num_queries_per_kv=4, dtype=torch.bfloat16, max_query_len=1)
    on = RocmUnifiedAttentionBackend()
    assert (
        on.grid_groups(cpu) == 8
        and on.attention_config("unified_attention_2d", cpu, **shape).kv_cache_modifier
    )
    monkeypatch.setenv(DISABLE_ENV, "xcd_order, kv_cache_modifier")
    off = RocmUnifiedAttentionBackend()
    assert off.grid_groups(cpu) == 1
    assert off.attention_config("unified_attention_2d", cpu, **shape).kv_cache_modifier == ""
    assert RocmUnifiedAttentionBackend(xcd_order=True).grid_groups(cpu) == 8  # the argument wins
    monkeypatch.setenv(DISABLE_ENV, "xcd")
    with pytest.raises(ValueError, match="unknown \\['xcd'\\]"):
        RocmUnifiedAttentionBackend()


def test_full_graph_key_is_the_inherited_plan_with_the_amd_thresholds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedserve.platforms.api import PLUGIN_API_VERSION, AttentionLayerShape
    from pagedserve.worker.graphs.full_cuda_graphs import DecodeGraphBuffers
    from pagedserve_rocm.attention import RocmUnifiedAttentionBackend
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    assert plugin.PAGEDSERVE_PLUGIN_API == PLUGIN_API_VERSION
    assert RocmUnifiedAttentionBackend.full_graph_key is TritonUnifiedAttentionBackend.full_graph_key
    monkeypatch.delenv(ARCH_ENV, raising=False)
    _fake_gpu(monkeypatch, hip="6.4", arch="gfx942:sramecc+:xnack-")  # an MI300X, 304 CUs
    backend = RocmUnifiedAttentionBackend()
    device = torch.device("cuda", 0)
    layer = AttentionLayerShape(32, 8, 128, 16, torch.bfloat16, torch.bfloat16, device)
    keys = []
    for bucket in (256, 1024, 4096):
        md = DecodeGraphBuffers(1, 4, torch.device("cpu")).metadata(1, bucket)
        key = backend.full_graph_key(md, layer)
        assert key == backend.plan(
            md,
            num_q_heads=32,
            num_kv_heads=8,
            head_size=128,
            block_size=16,
            dtype=torch.bfloat16,
            device=device,
        )
        keys.append(key)
    assert len(set(keys)) == 3 and all(k.kind == "3d" for k in keys)  # one request splits by length
