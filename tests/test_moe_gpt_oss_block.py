"""gpt-oss's mixture-of-experts block against transformers' (`GptOssMLP`): biased router, top-k
then softmax, clamped SwiGLU experts with biases, loaded from its stacked, interleaved layout in
bfloat16 form and from MXFP4 blocks and scales (dequantized as transformers dequantizes them)."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from pagedserve.models.gpt_oss import GptOssForCausalLM
from pagedserve.models.mxfp4 import dequantize_mxfp4
from pagedserve.moe.layer import SparseMoE


def _config() -> GptOssConfig:
    return GptOssConfig(
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=3,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=32,
    )


def _hf_block(seed: int) -> GptOssMLP:
    torch.manual_seed(seed)
    block = GptOssMLP(_config())
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return block


def _ours(tensors: dict[str, torch.Tensor]) -> SparseMoE:
    config = _config()
    options = GptOssForCausalLM.options_from_config(config)
    block = GptOssForCausalLM.feed_forward(config, 0, options)
    assert isinstance(block, SparseMoE)
    loaded = set()
    for name, tensor in tensors.items():
        name = name.replace("router.", "gate.")
        key = block.load_checkpoint_tensor(name, tensor)
        if key is None:
            block.get_parameter(name).data.copy_(tensor)
        else:
            loaded.add(key)
    assert block.missing_checkpoint_keys(loaded) == []
    return block


def test_block_equals_transformers() -> None:
    hf = _hf_block(0)
    ours = _ours({name: p.detach().clone() for name, p in hf.named_parameters()})
    x = torch.randn(11, 64)
    expected, _ = hf(x[None])
    torch.testing.assert_close(ours(x), expected[0], rtol=1e-5, atol=1e-5)


def test_missing_bias_is_named() -> None:
    tensors = {name: p.detach().clone() for name, p in _hf_block(1).named_parameters()}
    block = _ours(tensors)
    loaded = {"w13:all", "w2:all", "w13_bias:all"}
    assert block.missing_checkpoint_keys(loaded) == ["w2_bias:all"]


def _mxfp4_encode(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [..., N, K] matrix of exact MXFP4 values as blocks [..., N, K/32, 16] and scales."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    *lead, n, k = matrix.shape
    groups = matrix.reshape(*lead, n, k // 32, 32)
    exponent = torch.randint(-3, 3, groups.shape[:-1])
    mantissa = groups / torch.pow(2.0, exponent.float()).unsqueeze(-1)
    codes = (mantissa.abs().unsqueeze(-1) - table).abs().argmin(-1) + 8 * (mantissa < 0)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_dequantizes_like_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16).transpose(1, 2)
    assert torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="do not pair up"):
        dequantize_mxfp4(blocks, scales[..., :1], torch.bfloat16)


def test_mxfp4_experts_load_to_the_dequantized_block() -> None:
    hf = _hf_block(2)
    tensors = {name: p.detach().clone() for name, p in hf.named_parameters()}
    # Round the two matrices to MXFP4 values (as a released checkpoint holds them), then encode.
    blocks, scales = _mxfp4_encode(tensors["experts.gate_up_proj"].transpose(1, 2))  # rows: channels
    gate_up = dequantize_mxfp4(blocks, scales, torch.float32)
    down_blocks, down_scales = _mxfp4_encode(tensors["experts.down_proj"].transpose(1, 2))
    down = dequantize_mxfp4(down_blocks, down_scales, torch.float32)
    plain = dict(
        tensors,
        **{"experts.gate_up_proj": gate_up.transpose(1, 2), "experts.down_proj": down.transpose(1, 2)},
    )
    packed = {k: v for k, v in tensors.items() if k not in ("experts.gate_up_proj", "experts.down_proj")}
    # Blocks and scales in either order: the block pairs them.
    packed |= {
        "experts.gate_up_proj_scales": scales,
        "experts.gate_up_proj_blocks": blocks,
        "experts.down_proj_blocks": down_blocks,
        "experts.down_proj_scales": down_scales,
    }
    a, b = _ours(plain), _ours(packed)
    assert torch.equal(a.w13, b.w13) and torch.equal(a.w2, b.w2)
