"""The batched sampler: greedy, penalties, bias, min_tokens, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from pagedserve.sampling import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    SamplingRequest,
    build_sampling_metadata,
)
from pagedserve.sampling.penalties import PenaltyTensors, apply_penalties
from pagedserve.sampling.sampler import apply_min_p, apply_top_k_top_p

NEG_INF = float("-inf")


def build(
    params: Sequence[SamplingParams],
    vocab_size: int,
    outputs: Sequence[Sequence[int]] | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    sample_indices: Sequence[int] | None = None,
) -> SamplingMetadata:
    requests = [
        SamplingRequest(
            params=p,
            prompt_token_ids=prompts[i] if prompts else [],
            output_token_ids=outputs[i] if outputs else [],
            sample_index=sample_indices[i] if sample_indices else 0,
        )
        for i, p in enumerate(params)
    ]
    return build_sampling_metadata(
        requests, vocab_size=vocab_size, eos_token_id=eos_token_id, generator=generator
    )


def test_greedy_is_exactly_argmax_with_ties() -> None:
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1.0  # tie: argmax takes the lowest id
    meta = build([SamplingParams(temperature=0)] * 5, 40)
    out = Sampler().forward(logits, meta)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert int(out.sampled_token_ids[1]) == 7
    assert out.logprobs is None


def test_sampler_does_not_mutate_logits() -> None:
    logits = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    p = SamplingParams(
        temperature=0.8, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.5, logit_bias={2: 3.0}, seed=1
    )
    Sampler().forward(logits, build([p, p], 16, outputs=[[1], [2]], prompts=[[3], [4]]))
    assert torch.equal(logits, before)


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, -2.0], [2.0, -1.0, 0.5, 0.0, 3.0, -2.0]])
    penalties = PenaltyTensors.build(
        presence=[0.25, 0.0],
        frequency=[0.5, 0.0],
        repetition=[2.0, 1.0],
        prompt_token_ids=[[0, 1], [0, 1]],
        output_token_ids=[[2, 2, 4], [2, 2, 4]],
        vocab_size=6,
        device=torch.device("cpu"),
    )
    apply_penalties(logits, penalties)
    # Row 0: repetition divides positive / multiplies negative logits of tokens {0, 1, 2, 4};
    # token 2 then loses 2 * 0.5 (frequency) + 0.25 (presence), token 4 loses 0.5 + 0.25.
    assert logits[0].tolist() == [1.0, -2.0, -1.0, 0.0, 0.75, -2.0]
    # Row 1 has neutral penalties: untouched.
    assert logits[1].tolist() == [2.0, -1.0, 0.5, 0.0, 3.0, -2.0]


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0, -2.0]] * 2)
    plain = SamplingParams(temperature=0)
    penalized = SamplingParams(
        temperature=0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    meta = build([penalized, plain], 6, outputs=[[2, 2, 4], [2, 2, 4]], prompts=[[0, 1], [0, 1]])
    assert Sampler().forward(logits, meta).sampled_token_ids.tolist() == [0, 4]


def test_negative_presence_penalty_encourages_repeats() -> None:
    logits = torch.tensor([[1.0, 1.2, 0.0]])
    meta = build([SamplingParams(temperature=0, presence_penalty=-0.5)], 3, outputs=[[0]])
    assert Sampler().forward(logits, meta).sampled_token_ids.tolist() == [0]


def test_penalty_history_outside_vocab_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"output token ids must be in \[0, 6\)"):
        build([SamplingParams(frequency_penalty=1.0)], 6, outputs=[[9]])


def test_logit_bias() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0]])
    meta = build(
        [
            SamplingParams(temperature=0, logit_bias={3: 10.0}),
            SamplingParams(temperature=0, logit_bias={1: -100.0}),
        ],
        4,
    )
    assert Sampler().forward(logits, meta).sampled_token_ids.tolist() == [3, 2]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build([SamplingParams(logit_bias={4: 1.0})], 4)


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    # EOS (1) is the most likely token, stop token 3 the second; token 0 the third.
    logits = torch.tensor([[1.0, 9.0, 0.0, 8.0]] * 4)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[3])
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    meta = build([p, p, p, ignore], 4, outputs=[[], [0], [0, 0], []], eos_token_id=1)
    # Rows 0 and 1 have generated fewer than 2 tokens: EOS and 3 are banned. Row 2 reached
    # min_tokens. Row 3 ignores EOS, so only its (empty) stop ids are banned: EOS stays allowed.
    assert Sampler().forward(logits, meta).sampled_token_ids.tolist() == [0, 0, 1, 1]


def test_top_k_keeps_ties_and_top_p_nucleus() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0]])
    apply_top_k_top_p(logits, torch.tensor([1]), None)
    assert logits.tolist() == [[NEG_INF, 2.0, 2.0, NEG_INF]]
    probs = torch.tensor([[0.1, 0.45, 0.3, 0.15]])
    logits = probs.log()
    apply_top_k_top_p(logits, None, torch.tensor([0.7]))
    # 0.45 < 0.7 <= 0.45 + 0.3: the nucleus is {1, 2}.
    assert torch.isinf(logits).tolist() == [[True, False, False, True]]
    logits = probs.log()
    apply_top_k_top_p(logits, None, torch.tensor([0.01]))
    assert torch.isinf(logits).tolist() == [[True, False, True, True]]
    logits = probs.log()
    # top-k first (keeps {1, 2, 3}, renormalized 0.5, 0.333, 0.167), then top-p 0.8 keeps {1, 2}.
    apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.8]))
    assert torch.isinf(logits).tolist() == [[True, False, False, True]]


def test_top_k_fast_path_matches_the_sort_path() -> None:
    logits = torch.randint(-3, 4, (6, 30), generator=torch.Generator().manual_seed(9)).float()  # many ties
    top_k = torch.tensor([1, 2, 5, 30, 7, 3])
    by_sort, by_topk = logits.clone(), logits.clone()
    apply_top_k_top_p(by_sort, top_k, None)
    apply_top_k_top_p(by_topk, top_k, None, max_top_k=7)  # row 3 has top-k disabled (k == vocab)
    assert torch.equal(by_sort, by_topk)
    assert not torch.isinf(by_topk[3]).any()
    assert int((~torch.isinf(by_topk[0])).sum()) == int((logits[0] == logits[0].max()).sum())


def test_min_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]).log()
    apply_min_p(logits, torch.tensor([0.5, 0.0]))
    assert torch.isinf(logits).tolist() == [[False, False, True], [False, False, False]]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), [0.5, 0.3, 0.2]),
        (SamplingParams(temperature=0.5), [0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]),
        (SamplingParams(top_k=2), [0.625, 0.375, 0.0]),
        (SamplingParams(top_p=0.6), [0.625, 0.375, 0.0]),
        (SamplingParams(min_p=0.5), [0.625, 0.375, 0.0]),
    ],
)
def test_random_sampling_follows_the_distribution(params: SamplingParams, expected: list[float]) -> None:
    rows = 6000
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(rows, 3).contiguous()
    meta = build([params] * rows, 3, generator=torch.Generator().manual_seed(123))
    counts = torch.bincount(Sampler().forward(logits, meta).sampled_token_ids, minlength=3)
    freq = (counts.double() / rows).tolist()
    for got, want in zip(freq, expected, strict=True):
        # 4.5 standard deviations of a binomial frequency: fails by chance less than once in 10^5.
        assert abs(got - want) <= 4.5 * math.sqrt(max(want * (1 - want), 1e-9) / rows) + 1e-9


def _generate(
    position: int, batch: Sequence[SamplingParams], logits_per_step: list[torch.Tensor]
) -> list[int]:
    """Run several steps for a batch and return the tokens of row `position`."""
    outputs: list[list[int]] = [[] for _ in batch]
    for step_logits in logits_per_step:
        rows = step_logits.expand(len(batch), -1).contiguous()
        meta = build(
            batch, rows.shape[1], outputs=outputs, generator=torch.Generator().manual_seed(len(outputs[0]))
        )
        for row, token in enumerate(Sampler().forward(rows, meta).sampled_token_ids.tolist()):
            outputs[row].append(token)
    return outputs[position]


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    g = torch.Generator().manual_seed(5)
    logits_per_step = [torch.randn(1, 64, generator=g) * 0.3 for _ in range(8)]
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = _generate(0, [seeded], logits_per_step)
    others = [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.7, seed=99),
        SamplingParams(temperature=0),
    ]
    for position in range(4):
        batch = [*others[:position], seeded, *others[position:]]
        assert _generate(position, batch, logits_per_step) == alone
    different_seed = _generate(0, [SamplingParams(temperature=1.0, seed=1235)], logits_per_step)
    assert different_seed != alone


def test_parallel_samples_of_a_seeded_request_differ_and_reproduce() -> None:
    logits = (torch.randn(1, 64, generator=torch.Generator().manual_seed(6)) * 0.1).expand(2, -1).contiguous()
    p = SamplingParams(seed=7)

    def run() -> list[list[int]]:
        steps = []
        for step in range(6):
            meta = build([p, p], 64, outputs=[[0] * step, [0] * step], sample_indices=[0, 1])
            steps.append(Sampler().forward(logits, meta).sampled_token_ids.tolist())
        return steps

    first = run()
    assert [a for a, _ in first] != [b for _, b in first]
    assert run() == first


def test_logprobs_are_raw_log_softmax_with_top_n_and_rank() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(8)) * 3
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.5, repetition_penalty=1.7, logprobs=5, seed=3),
        SamplingParams(temperature=0),
    ]
    out = Sampler().forward(logits, build(params, 50, prompts=[[1], [1, 2], [3]], outputs=[[], [4], []]))
    assert out.logprobs is not None
    reference = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprobs.token_ids.shape == (3, 6)
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0], reference.gather(1, sampled[:, None])[:, 0], atol=1e-6, rtol=0
    )
    top_values, top_ids = reference.topk(5, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top_values, atol=1e-6, rtol=0)
    for row in range(3):
        expected_rank = int((reference[row] > reference[row, sampled[row]]).sum()) + 1
        assert int(out.logprobs.ranks[row]) == expected_rank
    assert int(out.logprobs.ranks[0]) == 1  # greedy without penalties picks the top token


def test_shape_mismatch_is_reported() -> None:
    meta = build([SamplingParams()], 10)
    with pytest.raises(ValueError, match=r"logits must be \[num_reqs=1, vocab_size=10\]"):
        Sampler().forward(torch.zeros(1, 11), meta)
    with pytest.raises(ValueError, match="empty batch"):
        build_sampling_metadata([], vocab_size=10, eos_token_id=None)


def test_disabled_features_cost_nothing() -> None:
    meta = build([SamplingParams(temperature=0), SamplingParams(top_k=-1)], 10)
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.penalties is None and meta.logit_edits is None and meta.max_num_logprobs is None
    assert not meta.all_greedy and not meta.all_random and meta.seeds == {}


def test_top_k_one_is_argmax_next_to_rows_without_top_k() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(10))
    params = [
        SamplingParams(top_k=1, seed=1),
        SamplingParams(seed=2),
        SamplingParams(top_k=1, temperature=2.0),
    ]
    for step in range(5):
        meta = build(params, 50, outputs=[[0] * step] * 3)
        assert meta.max_top_k == 1
        sampled = Sampler().forward(logits, meta).sampled_token_ids
        assert sampled[[0, 2]].tolist() == logits[[0, 2]].argmax(dim=-1).tolist()
