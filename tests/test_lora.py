"""Multi-LoRA serving in the offline engine: greedy tokens under each adapter equal transformers'
greedy generation of the same model with that adapter's deltas merged into its weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_support import merged_model, write_adapter
from models_harness import TINY_DECODER, hf_greedy, random_prompts, save_checkpoint, tiny_hf_model
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, PreTrainedModel

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineArgs
from pagedserve.kv_cache.hashing import extra_hash_key
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.request import LoRARequest

VOCAB = 256
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)


def _config() -> LlamaConfig:
    return LlamaConfig(**(TINY_DECODER | {"vocab_size": VOCAB, "intermediate_size": 128}))


@pytest.fixture(scope="module")
def hf_model() -> PreTrainedModel:
    return tiny_hf_model(_config(), seed=21)


@pytest.fixture(scope="module")
def checkpoint(hf_model: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def adapters(hf_model: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "x": write_adapter(
            root / "x", hf_model, rank=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"], seed=1
        ),
        "y": write_adapter(
            root / "y",
            hf_model,
            rank=8,
            alpha=16,
            targets=["k_proj", "o_proj", "gate_proj", "up_proj"],
            seed=2,
            rslora=True,
        ),
    }


@pytest.fixture(scope="module")
def requests(adapters: dict[str, Path]) -> dict[str, LoRARequest]:
    return {
        "x": LoRARequest("x", 1, str(adapters["x"])),
        "y": LoRARequest("y", 2, str(adapters["y"])),
    }


@pytest.fixture(scope="module")
def expected(hf_model: PreTrainedModel, adapters: dict[str, Path]) -> dict[str | None, PreTrainedModel]:
    """The model each request should behave as: the base (None) or an adapter's merged model."""
    return {None: hf_model} | {name: merged_model(hf_model, folder) for name, folder in adapters.items()}


def _lora_llm(checkpoint: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(
        skip_tokenizer_init=True, dtype="float32", max_model_len=64, block_size=4, enable_lora=True
    )
    return LLM(str(checkpoint), **(options | kwargs))


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return _lora_llm(checkpoint, max_loras=2, max_lora_rank=8)


def _generate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _names(loras: list[LoRARequest | None]) -> list[str | None]:
    return [None if lora is None else lora.lora_name for lora in loras]


def test_mixed_batch_matches_merged_models(
    llm: LLM, requests: dict[str, LoRARequest], expected: dict[str | None, PreTrainedModel]
) -> None:
    prompts = random_prompts(VOCAB, [7, 12, 5, 9, 14, 6], seed=4)
    loras = [None, requests["x"], requests["y"], requests["x"], requests["y"], None]
    got = _generate(llm, prompts, loras)
    for prompt, name, tokens in zip(prompts, _names(loras), got, strict=True):
        assert tokens == hf_greedy(expected[name], [prompt], MAX_TOKENS)[0], name
    # The adapters matter: each changes some answer of the base model.
    for name in ("x", "y"):
        assert hf_greedy(expected[name], prompts, MAX_TOKENS) != hf_greedy(
            expected[None], prompts, MAX_TOKENS
        )


def test_adapter_saved_by_peft_gives_peft_tokens(
    llm: LLM, hf_model: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An adapter as PEFT itself writes it (`get_peft_model(...).save_pretrained`), beside the base
    model in one batch, gives the greedy tokens of PEFT's own unmerged forward."""
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_rslora=True)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # PEFT starts B at zero; random A and B change the outputs
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    folder = tmp_path_factory.mktemp("peft_adapter")
    model.save_pretrained(folder)
    prompts = random_prompts(VOCAB, [7, 12, 5, 9], seed=6)
    lora = LoRARequest("peft", 7, str(folder))
    got = _generate(llm, prompts, [lora, None, lora, lora])
    want = hf_greedy(model.eval(), prompts, MAX_TOKENS)
    base = hf_greedy(hf_model, prompts, MAX_TOKENS)
    assert got == [want[0], base[1], want[2], want[3]]
    assert want != base


def test_compiled_cpu_forward_gives_the_merged_tokens(
    checkpoint: Path, requests: dict[str, LoRARequest], expected: dict[str | None, PreTrainedModel]
) -> None:
    """The adapters' mapping is data the compiled forward reads each step: one compilation serves
    every mix of adapters. A model of the same class without LoRA layers is compiled first in this
    process: its graph (traced with module guards off) must not run for the LoRA model."""
    plain = LLM(
        str(checkpoint), skip_tokenizer_init=True, dtype="float32", max_model_len=64, cpu_compile=True
    )
    assert plain.engine.core.runner.compiled is not None
    plain.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm = _lora_llm(checkpoint, max_loras=2, max_lora_rank=8, cpu_compile=True)
    assert llm.engine.core.runner.compiled is not None
    prompts = random_prompts(VOCAB, [7, 12, 5, 9], seed=5)
    for loras in ([requests["y"], None, requests["x"], requests["y"]], [None, requests["x"], None, None]):
        got = _generate(llm, prompts, loras)
        for prompt, name, tokens in zip(prompts, _names(loras), got, strict=True):
            assert tokens == hf_greedy(expected[name], [prompt], MAX_TOKENS)[0], name


def test_prefix_cache_is_not_shared_between_adapters(
    llm: LLM, requests: dict[str, LoRARequest], expected: dict[str | None, PreTrainedModel]
) -> None:
    prompt = random_prompts(VOCAB, [13], seed=9)[0]  # three full blocks of 4 tokens
    want = {name: hf_greedy(model, [prompt], MAX_TOKENS)[0] for name, model in expected.items()}
    assert len(set(map(tuple, want.values()))) == 3
    for _ in range(2):  # the second round reads each adapter's own cached blocks
        for lora in (None, requests["x"], requests["y"]):
            name = None if lora is None else lora.lora_name
            out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
            assert list(out.outputs[0].token_ids) == want[name], name
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=requests["x"])[0]
    assert again.num_cached_tokens == 12  # the cache serves an adapter its own blocks


def test_one_slot_runs_adapters_in_turn(
    checkpoint: Path, requests: dict[str, LoRARequest], expected: dict[str | None, PreTrainedModel]
) -> None:
    """With max_loras=1 the requests of a second adapter wait for the first adapter's to finish."""
    llm = _lora_llm(checkpoint, max_loras=1, max_lora_rank=8)
    prompts = random_prompts(VOCAB, [6, 8, 10, 7], seed=5)
    loras = [requests["x"], requests["y"], None, requests["x"]]
    got = _generate(llm, prompts, loras)
    for prompt, name, tokens in zip(prompts, _names(loras), got, strict=True):
        assert tokens == hf_greedy(expected[name], [prompt], MAX_TOKENS)[0], name


def test_block_hash_key_depends_on_adapter() -> None:
    assert extra_hash_key(None, None, 0) == extra_hash_key(None, None) == b""
    assert extra_hash_key(None, None, 1) != extra_hash_key(None, None, 2)


# ---- refusals ------------------------------------------------------------------------------------


def test_lora_int_id_must_be_positive() -> None:
    with pytest.raises(ValueError, match="lora_int_id must be an int >= 1"):
        LoRARequest("a", 0, "/nowhere")


def _refused(llm: LLM, lora: LoRARequest, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=lora)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ({"rank": 16}, "more than max_lora_rank=8"),
        ({"targets": ["lm_head"]}, "not supported"),
        ({"config_extra": {"bias": "all"}}, "bias='all' is not supported"),
        ({"config_extra": {"fan_in_fan_out": True}}, "fan_in_fan_out=True"),
        ({"layers": range(3)}, "weights for layer 2, the model only 2 layers"),
    ],
)
def test_bad_adapters_are_refused(
    llm: LLM, hf_model: PreTrainedModel, tmp_path: Path, case: dict[str, Any], match: str
) -> None:
    options: dict[str, Any] = {"rank": 4, "alpha": 4, "targets": ["q_proj"], "seed": 3} | case
    targets = options["targets"]
    if targets == ["lm_head"]:  # no tensors to write: only the config names it
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / "adapter_config.json").write_text(
            json.dumps({"r": 4, "lora_alpha": 4, "target_modules": targets})
        )
        save_file({}, str(tmp_path / "adapter_model.safetensors"))
    else:
        write_adapter(tmp_path, hf_model, **options)
    _refused(llm, LoRARequest("bad", 90, str(tmp_path)), match)


def test_missing_files_and_mismatched_shapes_are_refused(
    llm: LLM, hf_model: PreTrainedModel, tmp_path: Path
) -> None:
    _refused(llm, LoRARequest("none", 91, str(tmp_path / "absent")), "no adapter_config.json")
    folder = write_adapter(tmp_path / "no_tensors", hf_model, rank=4, alpha=4, targets=["q_proj"], seed=1)
    (folder / "adapter_model.safetensors").unlink()
    _refused(llm, LoRARequest("no_tensors", 92, str(folder)), "no adapter_model.safetensors")
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{key}.lora_A.weight": torch.zeros(4, 32), f"{key}.lora_B.weight": torch.zeros(64, 4)},
        str(wide / "adapter_model.safetensors"),
    )
    _refused(llm, LoRARequest("wide", 93, str(wide)), "maps 32 -> 64 features, the model's 64 -> 64")


def test_one_id_names_one_adapter(llm: LLM, requests: dict[str, LoRARequest]) -> None:
    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False, lora_request=requests["x"])  # id 1 is known
    _refused(llm, LoRARequest("x2", 1, requests["y"].lora_path), "lora_int_id=1 already names adapter")


def test_lora_request_needs_enable_lora(checkpoint: Path, requests: dict[str, LoRARequest]) -> None:
    plain = LLM(str(checkpoint), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    _refused(plain, requests["x"], "built without LoRA: build it with enable_lora=True")


def test_lora_request_list_must_match_prompts(llm: LLM, requests: dict[str, LoRARequest]) -> None:
    with pytest.raises(ValueError, match="got 2 lora_requests for 1 prompts"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False, lora_request=[requests["x"], None])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tensor_parallel_size": 2}, "needs tensor_parallel_size=1"),
        ({"data_parallel_size": 2}, "needs data_parallel_size=1"),
    ],
)
def test_unsupported_engines_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(enable_lora=True, **options)


def test_transformers_fallback_is_refused() -> None:
    with pytest.raises(ValueError, match="transformers fallback"):
        LoRAManager(nn.Linear(2, 2), max_loras=1, max_rank=4, max_tokens=8)
