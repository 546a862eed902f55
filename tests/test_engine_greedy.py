"""End to end on cpu_reference: the engine's greedy tokens equal HF transformers' `generate`.

Tiny random models are saved as safetensors checkpoints and served through `LLM`, under the
conditions that stress the scheduler and the runner: chunked prefill forced small, prefix caching
on and off, and preemption forced by a KV pool too small for every request at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import hf_greedy, random_prompts, save_checkpoint, tiny_hf_model
from transformers import GPTNeoXConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve import LLM, SamplingParams

VOCAB = 96
MAX_NEW = 12


def _small(config_cls: type, **extra: object) -> object:
    return config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **extra,
    )


CONFIGS = {
    "llama": lambda: _small(LlamaConfig),
    "mistral": lambda: _small(MistralConfig, sliding_window=8),
    "qwen2": lambda: _small(Qwen2Config),
    "qwen3": lambda: _small(Qwen3Config),
    # No native implementation: served through the transformers fallback (partial rotary).
    "gpt_neox": lambda: GPTNeoXConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rotary_pct=0.5,
        tie_word_embeddings=False,
    ),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    """arch -> (checkpoint dir, HF greedy continuations of PROMPTS)."""
    out = {}
    for i, (arch, make) in enumerate(CONFIGS.items()):
        hf = tiny_hf_model(make(), seed=i)
        path = save_checkpoint(hf, tmp_path_factory.mktemp(arch))
        out[arch] = (path, hf_greedy(hf, PROMPTS, MAX_NEW))
    return out


# Different lengths, not block multiples; the last two share a 12-token prefix.
PROMPTS = random_prompts(VOCAB, [5, 17, 30, 3], seed=7)
PROMPTS.append([*PROMPTS[2][:12], 5, 6, 7])
PROMPTS.append([*PROMPTS[2][:12], 9, 1])

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)


def _llm(path: Path, **engine: object) -> LLM:
    """An engine on a tiny checkpoint: token ids only, float32, blocks of 4, 64-token context."""
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=64, **engine)


def _generate(path: Path, prompts: list[list[int]], **engine: object) -> list[list[int]]:
    llm = _llm(path, **engine)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_greedy_matches_hf(checkpoints: dict, arch: str) -> None:
    path, expected = checkpoints[arch]
    assert _generate(path, PROMPTS, num_kv_blocks=128) == expected


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param({"max_num_batched_tokens": 8, "max_num_seqs": 4, "num_kv_blocks": 128}, id="chunked-8"),
        pytest.param({"enable_prefix_caching": False, "num_kv_blocks": 128}, id="no-prefix-cache"),
        pytest.param({"num_kv_blocks": 14, "max_num_seqs": 6}, id="preemption"),
    ],
)
def test_greedy_matches_hf_under_pressure(checkpoints: dict, engine: dict) -> None:
    path, expected = checkpoints["llama"]
    assert _generate(path, PROMPTS, **engine) == expected


def test_preemption_really_happens(checkpoints: dict) -> None:
    path, expected = checkpoints["llama"]
    llm = _llm(path, num_kv_blocks=14, max_num_seqs=6)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.core.scheduler.num_preemptions > 0


def test_prefix_cache_hits_are_reported(checkpoints: dict) -> None:
    path, expected = checkpoints["llama"]
    llm = _llm(path, num_kv_blocks=128)
    first = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    again = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    # 30 prompt tokens, blocks of 4: the 7 full blocks (28 tokens) are cached.
    assert again.num_cached_tokens == 28
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == expected[2]
    # Forgotten: the prompt's 7 registered blocks (and any its decodes filled) are recomputed.
    assert llm.reset_prefix_cache() is True  # vLLM's answer: the whole cache was reset
    fresh = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == expected[2]
    # Blocks of a finished request that no lookup has registered yet are forgotten as well.
    llm.reset_prefix_cache()
    assert llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_logprobs_match_hf_log_softmax(checkpoints: dict, tmp_path: Path) -> None:
    path, _ = checkpoints["qwen2"]
    hf = tiny_hf_model(CONFIGS["qwen2"](), seed=list(CONFIGS).index("qwen2"))
    prompt = PROMPTS[1]
    llm = _llm(path, num_kv_blocks=64)
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, detokenize=False, logprobs=3, prompt_logprobs=2
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    sample = out.outputs[0]
    assert sample.logprobs is not None and len(sample.logprobs) == 4
    for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + step]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(entry)
        assert entry[token].rank == 1  # greedy picks the most likely token
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry is not None
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
    assert sample.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs, strict=True))
    )


def test_n2_shares_prompt_blocks_and_differs(checkpoints: dict) -> None:
    path, _ = checkpoints["llama"]
    llm = _llm(path, num_kv_blocks=64)
    engine = llm.engine
    prompt = PROMPTS[2]  # 30 tokens: 7 full blocks and a partial one
    engine.add_request(
        "r",
        prompt,
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, detokenize=False),
    )
    kv = engine.core.scheduler.kv
    shared_seen = False
    while engine.has_unfinished_requests():
        outputs = engine.step()
        a, b = kv.block_ids("r#0"), kv.block_ids("r#1")
        if a and b:
            # The 7 full prompt blocks are the same physical blocks, each held by both samples.
            assert a[:7] == b[:7]
            for block in kv.blocks("r#0")[:7]:
                assert block.ref_cnt == 2
            # The partial last prompt block was copied on write: the samples diverge there.
            assert a[7] != b[7]
            shared_seen = True
        for o in outputs:
            if o.finished:
                final = o
    assert shared_seen
    assert len(final.outputs) == 2 and all(len(c.token_ids) == 8 for c in final.outputs)
    assert final.outputs[0].token_ids != final.outputs[1].token_ids


def test_seeded_sampling_is_independent_of_batch(checkpoints: dict) -> None:
    path, _ = checkpoints["llama"]
    llm = _llm(path, num_kv_blocks=128)
    seeded = SamplingParams(
        temperature=0.8, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True, detokenize=False
    )
    other = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, detokenize=False)
    alone = llm.generate([PROMPTS[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1]], [other, other, seeded], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone


def test_fallback_architecture_runs_through_transformers(checkpoints: dict) -> None:
    path, expected = checkpoints["gpt_neox"]
    llm = _llm(path, num_kv_blocks=128, max_num_batched_tokens=8, max_num_seqs=4)
    assert llm.engine.setup.loaded.spec.implementation == "transformers"
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
