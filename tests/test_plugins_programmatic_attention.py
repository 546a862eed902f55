"""Programmatic launches of attention and cache writes (plugin API 1.6): the engine asks the
attention backend and the cache ops once, and only when the linear layers and the compiled forward
launch that way; plugins that do not implement the hook keep launching plainly."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.compile.gpu_compile import PROGRAMMATIC_MAX_TOKENS
from pagedserve.worker.startup.device_model import _launch_attention_programmatically
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps


class _RecordingBackend(ReferenceAttentionBackend):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def enable_programmatic_launch(self, max_tokens: int) -> bool:
        self.asked.append(max_tokens)
        return True


def test_plugins_without_the_hook_answer_no_and_keep_working() -> None:
    """The defaults of API 1.6: False, and nothing about the backend or cache ops changes."""
    backend, cache_ops = ReferenceAttentionBackend(), ReferenceCacheOps()
    assert backend.enable_programmatic_launch(16) is False
    assert cache_ops.enable_programmatic_launch(16) is False
    query = torch.randn(2, 2, 8, dtype=torch.float64)
    cache = torch.randn(2, 4, 16, 1, 8, dtype=torch.float64)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    metadata = AttentionMetadata.build([1, 1], [5, 9], table, 16)
    assert torch.isfinite(backend.forward(query, cache, metadata, scale=0.3)).all()


def test_the_engine_asks_both_with_the_compiled_forwards_token_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, cache_ops = _RecordingBackend(), ReferenceCacheOps()
    with caplog.at_level(logging.INFO, logger="pagedserve.worker.startup.device_model"):
        _launch_attention_programmatically(backend, cache_ops)
    assert backend.asked == [PROGRAMMATIC_MAX_TOKENS]
    text = caplog.text
    assert f"attention: programmatic dependent launches for steps of <= {PROGRAMMATIC_MAX_TOKENS}" in text
    assert "cache writes: plain launches (the plugin has none)" in text


def test_triton_backend_refuses_a_negative_bound_and_launches_plainly_without_the_feature() -> None:
    """On a device without programmatic launches (here: the interpreter's CPU) an enabled backend
    computes what a plain one does."""
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    backend = TritonUnifiedAttentionBackend(num_splits=4)
    with pytest.raises(ValueError, match="max_tokens=-1"):
        backend.enable_programmatic_launch(-1)
    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 4, 32, generator=gen)
    cache = torch.randn(2, 6, 16, 2, 32, generator=gen)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    metadata = AttentionMetadata.build([1, 1], [40, 33], table, 16)
    plain = backend.forward(query, cache, metadata, scale=0.25)
    assert backend.enable_programmatic_launch(PROGRAMMATIC_MAX_TOKENS) is True
    assert torch.equal(backend.forward(query, cache, metadata, scale=0.25), plain)


def test_cuda_backend_passes_the_bound_to_its_triton_backend() -> None:
    pytest.importorskip("pagedserve_cuda")
    from pagedserve_cuda.attention import CudaPagedAttentionBackend

    backend = CudaPagedAttentionBackend()
    assert backend.enable_programmatic_launch(8) is True
    triton_backend = backend._triton_backend()
    assert triton_backend._dependent_max_tokens == 8  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="max_tokens=-2"):
        backend.enable_programmatic_launch(-2)


def test_cuda_cache_writes_build_a_dependent_variant_for_sm90_only() -> None:
    """DEPENDENT=1 adds the device-side wait on sm_90 and compiles to the plain kernel before it."""
    compiler = pytest.importorskip("pagedserve_cuda.compiler")
    from pagedserve_cuda.cache_ops import _source, fp8_source

    try:
        compiler.load_nvrtc()
    except compiler.CudaToolError as e:
        pytest.skip(str(e))
    for plain, dependent in (
        (_source(16), _source(16, dependent=True)),
        (
            fp8_source(torch.bfloat16, torch.float8_e4m3fn),
            fp8_source(torch.bfloat16, torch.float8_e4m3fn, dependent=True),
        ),
    ):
        assert ("DEPENDENT", 1) in dependent.defines and ("DEPENDENT", 0) in plain.defines
        cubins = {
            (arch, source is dependent): compiler.compile_to_cubin(
                source.text(), source.file, source.options(arch)
            )
            for arch in ("sm_80", "sm_90")
            for source in (plain, dependent)
        }
        assert cubins[("sm_80", True)] == cubins[("sm_80", False)]
        assert cubins[("sm_90", True)] != cubins[("sm_90", False)]
