"""Logprob tensors and their conversion, and parity with Hugging Face on a tiny random Llama:
greedy (with repetition penalty) picks HF's tokens, and sampled and prompt logprobs are within 1e-4
of HF's log_softmax."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling import (
    Sampler,
    SamplingParams,
    SamplingRequest,
    build_sampling_metadata,
)
from pagedserve.sampling.logprobs import (
    LogprobsTensors,
    compute_prompt_logprobs,
    gather_logprobs,
    logprobs_to_dicts,
)


def test_gather_logprobs_rank_counts_strictly_better_tokens() -> None:
    logprobs = torch.tensor([[-1.0, -0.5, -0.5, -3.0], [-1.0, -0.5, -0.5, -3.0]])
    t = gather_logprobs(logprobs, torch.tensor([2, 3]), num_logprobs=2)
    assert t.token_ids.tolist() == [[2, 1, 2], [3, 1, 2]]
    assert t.logprobs.tolist() == [[-0.5, -0.5, -0.5], [-3.0, -0.5, -0.5]]
    assert t.ranks.tolist() == [1, 4]


def test_logprobs_to_dicts() -> None:
    tensors = LogprobsTensors(
        token_ids=torch.tensor([[5, 5, 2, 9], [7, 1, 2, 3], [4, 4, 0, 1]]),
        logprobs=torch.tensor([[-0.1, -0.1, -2.0, -3.0], [-5.0, -0.2, -0.3, -0.4], [-0.5, -0.5, -1.0, -2.0]]),
        ranks=torch.tensor([1, 12, 1]),
    )
    dicts = logprobs_to_dicts(tensors, [2, 3, 0], decode=lambda t: f"<{t}>")
    # The sampled token is among the top 2: two entries. Outside the top 3: four entries.
    assert list(dicts[0]) == [5, 2] and dicts[0][2] == Logprob(-2.0, 2, "<2>")
    assert dicts[0][5].logprob == pytest.approx(-0.1) and dicts[0][5].rank == 1
    assert list(dicts[1]) == [7, 1, 2, 3]
    assert dicts[1][7].rank == 12 and dicts[1][3].rank == 3
    assert dicts[2] == {4: Logprob(-0.5, 1, "<4>")}
    assert logprobs_to_dicts(tensors, [0, 0, 0])[1] == {7: Logprob(-5.0, 12, None)}
    with pytest.raises(ValueError, match="wants 4 logprobs but only 3"):
        logprobs_to_dicts(tensors, [4, 0, 0])
    with pytest.raises(ValueError, match="2 entries for 3 rows"):
        logprobs_to_dicts(tensors, [1, 1])


def test_compute_prompt_logprobs_checks_shapes() -> None:
    with pytest.raises(ValueError, match="next_token_ids"):
        compute_prompt_logprobs(torch.zeros(3, 8), torch.zeros(2, dtype=torch.int64), 1)


@pytest.fixture(scope="module")
def tiny_llama() -> Any:  # transformers' own annotations of generate() do not type-check
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model: Any = LlamaForCausalLM(config).eval()
    return model


@torch.no_grad()
def test_greedy_with_repetition_penalty_and_logprobs_match_hf(tiny_llama: Any) -> None:
    prompt = [1, 17, 33, 17, 50, 61, 5]
    new_tokens = 10
    hf = tiny_llama.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        repetition_penalty=1.8,
        output_logits=True,
        return_dict_in_generate=True,
    )
    hf_tokens = hf.sequences[0, len(prompt) :].tolist()
    params = SamplingParams(temperature=0, repetition_penalty=1.8, logprobs=3, max_tokens=new_tokens)
    sampler = Sampler()
    ours: list[int] = []
    for step in range(new_tokens):
        logits = tiny_llama(torch.tensor([prompt + ours])).logits[:, -1].float()
        meta = build_sampling_metadata(
            [SamplingRequest(params, prompt, ours)], vocab_size=96, eos_token_id=None
        )
        out = sampler.forward(logits, meta)
        token = int(out.sampled_token_ids[0])
        ours.append(token)
        hf_logprobs = torch.log_softmax(hf.logits[step][0].float(), dim=-1)
        assert out.logprobs is not None
        assert abs(float(out.logprobs.logprobs[0, 0]) - float(hf_logprobs[token])) < 1e-4
        top3 = hf_logprobs.topk(3).values
        torch.testing.assert_close(out.logprobs.logprobs[0, 1:], top3, atol=1e-4, rtol=0)
    assert ours == hf_tokens
    # The penalty matters for this prompt: plain greedy picks differently.
    plain = tiny_llama.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
    )
    assert plain[0, len(prompt) :].tolist() != hf_tokens


@torch.no_grad()
def test_prompt_logprobs_match_hf(tiny_llama: Any) -> None:
    prompt = torch.tensor([1, 9, 40, 40, 77, 3, 12])
    logits = tiny_llama(prompt[None]).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    # Two chunks, as chunked prefill would deliver them.
    chunks = [compute_prompt_logprobs(logits[s:e], prompt[s + 1 : e + 1], 4) for s, e in [(0, 3), (3, 6)]]
    chosen = torch.cat([c.logprobs[:, 0] for c in chunks])
    expected = reference[:-1].gather(1, prompt[1:, None])[:, 0]
    torch.testing.assert_close(chosen, expected, atol=1e-4, rtol=0)
    top = torch.cat([c.token_ids[:, 1:] for c in chunks])
    assert torch.equal(top, reference[:-1].topk(4).indices)


def test_logprobs_beyond_vocab_are_rejected() -> None:
    with pytest.raises(ValueError, match="logprobs=11 asks for more top tokens than the vocabulary has"):
        build_sampling_metadata(
            [SamplingRequest(SamplingParams(logprobs=11), [1], [])], vocab_size=10, eos_token_id=None
        )


def test_completion_output_finished() -> None:
    running = CompletionOutput(index=0, text="a", token_ids=[3], cumulative_logprob=None, logprobs=None)
    done = CompletionOutput(
        1, "ab", [3, 4], -1.5, [{3: Logprob(-1.0, 1)}, {4: Logprob(-0.5, 2)}], "stop", "b"
    )
    assert not running.finished() and done.finished()
    out = RequestOutput("r0", "hi", [1, 2], None, [running, done], finished=False, num_cached_tokens=0)
    assert [o.index for o in out.outputs] == [0, 1]
