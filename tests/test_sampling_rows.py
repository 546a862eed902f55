"""The persistent sampling rows: metadata derived from per-row arrays, cached across steps, must
equal a from-scratch build for the same requests; and the counter-based seeded noise."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from pagedserve.sampling import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    SamplingRequest,
    build_sampling_metadata,
)
from pagedserve.sampling.metadata import step_seed
from pagedserve.sampling.noise import (
    request_seed_hash,
    seeded_exponential,
    splitmix64,
    splitmix64_np,
    step_seeds,
)
from pagedserve.sampling.rows import SamplingRows, TokenHistories

VOCAB = 40
EOS = 3

PARAMS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=5, seed=11),
    SamplingParams(temperature=0.7, min_p=0.1),
    SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=2),
    SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=-0.3, seed=4),
    SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[7]),
    SamplingParams(temperature=1.2, logit_bias={5: 2.0, 9: -4.0}, top_k=3, top_p=0.8),
]


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def assert_same_metadata(got: SamplingMetadata, want: SamplingMetadata) -> None:
    for name in ("num_reqs", "vocab_size", "all_greedy", "all_random", "max_top_k", "max_num_logprobs"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("temperature", "greedy", "top_k", "top_p", "top_p_rows", "min_p"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert _equal(a, b), name
    assert got.seeds == want.seeds
    assert (got.penalties is None) == (want.penalties is None)
    if got.penalties is not None and want.penalties is not None:
        for name in ("presence", "frequency", "repetition"):
            assert _equal(getattr(got.penalties, name), getattr(want.penalties, name)), name
        for name in ("prompt_token_ids", "output_token_ids"):
            a, b = getattr(got.penalties, name), getattr(want.penalties, name)
            # Histories are padded to the longest used one: compare them as token multisets.
            assert _histograms(a) == _histograms(b), name
    edits = [_edit_set(got), _edit_set(want)]
    assert edits[0] == edits[1]


def _histograms(padded: torch.Tensor) -> list[list[int]]:
    return [sorted(t for t in row.tolist() if t != VOCAB) for row in padded]


def _edit_set(meta: SamplingMetadata) -> set[tuple[int, int, float]]:
    if meta.logit_edits is None:
        return set()
    e = meta.logit_edits
    return set(zip(e.rows.tolist(), e.token_ids.tolist(), e.values.tolist(), strict=True))


class Model:
    """A persistent batch in miniature: rows of requests with growing outputs, rows dropped by
    moving the last row into the hole (as InputBatch does)."""

    def __init__(self, capacity: int) -> None:
        self.rows = SamplingRows(capacity)
        self.requests: list[tuple[SamplingParams, list[int], list[int], int]] = []
        self.token_ids = np.zeros((capacity, 64), dtype=np.int64)

    def add(self, params: SamplingParams, prompt: list[int], sample_index: int) -> None:
        row = self.rows.add(params, sample_index)
        assert row == len(self.requests)
        self.requests.append((params, prompt, [], sample_index))
        self.token_ids[row, : len(prompt)] = prompt

    def remove(self, row: int) -> None:
        last = len(self.requests) - 1
        self.rows.remove(row)
        self.requests[row] = self.requests[last]
        self.token_ids[row] = self.token_ids[last]
        self.requests.pop()

    def append(self, row: int, token: int) -> None:
        _, prompt, outputs, _ = self.requests[row]
        self.token_ids[row, len(prompt) + len(outputs)] = token
        outputs.append(token)

    def metadata(self, generator: torch.Generator | None = None) -> SamplingMetadata:
        n = len(self.requests)
        num_prompt = np.array([len(r[1]) for r in self.requests], dtype=np.int64)
        num_known = num_prompt + np.array([len(r[2]) for r in self.requests], dtype=np.int64)
        histories = TokenHistories(self.token_ids, np.arange(n, dtype=np.int64), num_prompt, num_known)
        return self.rows.metadata(
            histories, vocab_size=VOCAB, eos_token_id=EOS, device=torch.device("cpu"), generator=generator
        )

    def reference(self) -> SamplingMetadata:
        requests = [SamplingRequest(p, prompt, list(out), idx) for p, prompt, out, idx in self.requests]
        return build_sampling_metadata(requests, vocab_size=VOCAB, eos_token_id=EOS)


def test_persistent_rows_match_a_fresh_build_through_joins_leaves_and_steps() -> None:
    rng = random.Random(0)
    model = Model(capacity=12)
    for step in range(40):
        if len(model.requests) < 10 and rng.random() < 0.5:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
            model.add(rng.choice(PARAMS), prompt, sample_index=rng.randrange(3))
        if model.requests and rng.random() < 0.2:
            model.remove(rng.randrange(len(model.requests)))
        if not model.requests:
            continue
        got = model.metadata()
        assert_same_metadata(got, model.reference())
        # The same step asked twice (nothing changed) gives the same metadata.
        assert_same_metadata(model.metadata(), got)
        for row in range(len(model.requests)):
            if len(model.requests[row][2]) < 40:
                model.append(row, (step * 7 + row) % VOCAB)


def test_cached_metadata_follows_seeds_and_min_tokens_from_step_to_step() -> None:
    model = Model(capacity=4)
    model.add(SamplingParams(temperature=1.0, seed=5), [1, 2], sample_index=0)
    model.add(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7]), [1], sample_index=0)
    seeds = []
    for step in range(3):
        meta = model.metadata()
        seeds.append(meta.seeds[0])
        assert meta.seeds[0] == step_seed(5, 0, step)
        banned = {(r, t) for r, t, _ in _edit_set(meta)}
        assert banned == ({(1, EOS), (1, 7)} if step < 2 else set())
        model.append(0, 4)
        model.append(1, 4)
    assert len(set(seeds)) == 3


def test_all_greedy_batch_reuses_one_metadata_without_tensors() -> None:
    model = Model(capacity=4)
    for _ in range(3):
        model.add(SamplingParams(temperature=0), [1, 2, 3], sample_index=0)
    first = model.metadata()
    model.append(0, 5)
    assert model.metadata() is first  # nothing in it depends on the step
    assert first.all_greedy and first.temperature is None and first.greedy is None
    model.remove(1)
    assert model.metadata() is not first  # the rows changed


def test_sampled_positions_may_repeat_rows_for_drafts() -> None:
    rows = SamplingRows(4)
    p = SamplingParams(temperature=1.0, seed=9, frequency_penalty=1.0)
    rows.add(SamplingParams(temperature=0), 0)
    rows.add(p, 0)
    token_ids = np.array([[1, 2, 0, 0, 0], [3, 4, 5, 6, 8]], dtype=np.int64)
    # Row 1 has prompt [3, 4], output [5], drafts [6, 8]: three positions after 0, 1, 2 drafts.
    histories = TokenHistories(
        token_ids, np.array([0, 1, 1, 1]), np.array([2, 2, 2, 2]), np.array([2, 3, 4, 5])
    )
    meta = rows.metadata(
        histories, vocab_size=VOCAB, eos_token_id=None, device=torch.device("cpu"), generator=None
    )
    assert meta.seeds == {1: step_seed(9, 0, 1), 2: step_seed(9, 0, 2), 3: step_seed(9, 0, 3)}
    assert meta.penalties is not None
    assert _histograms(meta.penalties.output_token_ids) == [[], [5], [5, 6], [5, 6, 8]]


def test_remove_of_an_unused_row_is_refused() -> None:
    rows = SamplingRows(2)
    rows.add(SamplingParams(), 0)
    with pytest.raises(IndexError, match="row 1 is not in use"):
        rows.remove(1)
    rows.add(SamplingParams(), 0)
    with pytest.raises(RuntimeError, match="all 2 sampling rows are taken"):
        rows.add(SamplingParams(), 0)


def test_top_p_on_a_few_rows_samples_as_each_row_alone() -> None:
    # Seeded rows draw batch-independent noise, so each row's token must not depend on whether
    # top-p ran on the whole batch or (here: 2 of 8 rows use it) on a gathered subset.
    params = [
        SamplingParams(temperature=0.9, top_p=0.2, seed=1),
        SamplingParams(temperature=1.0, top_k=4, seed=2),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.1, top_k=30, top_p=0.3, seed=4),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, min_p=0.05, seed=5),
        SamplingParams(temperature=0.7, top_k=2, seed=6),
        SamplingParams(temperature=1.0, seed=7),
    ]
    generator = torch.Generator().manual_seed(2)
    for step in range(30):
        logits = torch.randn(len(params), VOCAB, generator=generator) * 0.5
        outputs = [[0] * step]
        batch = build_sampling_metadata(
            [SamplingRequest(p, [1], outputs[0]) for p in params], vocab_size=VOCAB, eos_token_id=None
        )
        assert batch.top_p_rows is not None and batch.top_p_rows.tolist() == [0, 3]
        together = Sampler().forward(logits, batch).sampled_token_ids.tolist()
        for row, p in enumerate(params):
            alone = build_sampling_metadata(
                [SamplingRequest(p, [1], outputs[0])], vocab_size=VOCAB, eos_token_id=None
            )
            assert alone.top_p_rows is None
            assert Sampler().forward(logits[row : row + 1], alone).sampled_token_ids.tolist() == [
                together[row]
            ]


# ---- noise ------------------------------------------------------------------------------------


def test_vectorised_seed_mixing_equals_the_scalar_one() -> None:
    rng = random.Random(1)
    seeds = [rng.randrange(-(2**63), 2**64) for _ in range(20)]
    indices = [rng.randrange(4) for _ in seeds]
    steps = np.array([rng.randrange(10_000) for _ in seeds], dtype=np.int64)
    hashes = np.array([request_seed_hash(s, i) for s, i in zip(seeds, indices, strict=True)], dtype=np.uint64)
    expected = [step_seed(s, i, int(t)) for s, i, t in zip(seeds, indices, steps, strict=True)]
    assert step_seeds(hashes, steps).tolist() == expected
    xs = np.array([rng.randrange(2**64) for _ in range(20)], dtype=np.uint64)
    assert splitmix64_np(xs).tolist() == [splitmix64(int(x)) for x in xs]


def test_seeded_noise_is_the_splitmix_stream_of_its_seed() -> None:
    seeds = torch.tensor([0, 1, 2**62 + 12345, 2**63 - 1], dtype=torch.int64)
    noise = seeded_exponential(seeds, 50)
    assert noise.shape == (4, 50) and noise.dtype == torch.float32
    for row, seed in enumerate(seeds.tolist()):
        states = (np.uint64(seed) + np.arange(50, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).astype(
            np.uint64
        )
        bits = splitmix64_np(states) >> np.uint64(40)
        uniform = (bits.astype(np.float64) + 0.5) * 2.0**-24
        # Compared as uniforms: float32 -log(u) loses relative precision as u nears 1.
        np.testing.assert_allclose(np.exp(-noise[row].double().numpy()), uniform, rtol=0, atol=1e-7)
    # A row depends on its seed only.
    assert torch.equal(seeded_exponential(seeds[2:3], 50)[0], noise[2])


def test_seeded_noise_is_exponential() -> None:
    noise = seeded_exponential(torch.arange(200, dtype=torch.int64) * 7919, 500).double()
    assert bool(torch.isfinite(noise).all()) and float(noise.min()) > 0
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e; 100k draws leave these within a few 1e-2.
    assert abs(float(noise.mean()) - 1) < 0.02
    assert abs(float(noise.var()) - 1) < 0.04
    assert abs(float((noise > 1).double().mean()) - math.exp(-1)) < 0.01


def test_seeded_rows_sample_their_distribution() -> None:
    rows = 4000
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().expand(rows, 3).contiguous()
    requests = [SamplingRequest(SamplingParams(seed=s), [1], []) for s in range(rows)]
    meta = build_sampling_metadata(requests, vocab_size=3, eos_token_id=None)
    freq = torch.bincount(Sampler().forward(logits, meta).sampled_token_ids, minlength=3).double() / rows
    for got, want in zip(freq.tolist(), [0.5, 0.3, 0.2], strict=True):
        assert abs(got - want) <= 4.5 * math.sqrt(want * (1 - want) / rows)
