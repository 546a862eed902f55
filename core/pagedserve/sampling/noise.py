"""Counter-based noise for seeded requests: a whole batch of seeded rows in one set of tensor ops.

A seeded row's noise must depend only on (seed, sample index, step), never on the batch. A
`torch.Generator` per row gives that, but costs a generator, a seeding and a kernel launch per
seeded row per step: host time that grows with the batch. Here the noise is a pure function
instead: row r's uniform for token i is the i-th output of a SplitMix64 stream started at the
row's step seed, `mix64(step_seed + i * GOLDEN)`, computed for all rows and tokens at once with
64-bit integer tensor ops (which wrap modulo 2**64 on every torch device). The same seed gives
the same noise on every device and in every batch.

The step seed itself (`step_seeds`) is SplitMix64 applied three times, over the request's seed,
its sample index and its step; the first two depend only on the request, so a persistent batch
computes them once (`request_seed_hashes`) and only the last mix per step.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_UNIFORM_BITS = 24  # float32 holds 24-bit integers exactly: uniforms on a grid of 2**-24


def splitmix64(x: int) -> int:
    """SplitMix64's output for state `x` (a well-mixed 64-bit bijection of x + GOLDEN)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def splitmix64_np(x: np.ndarray) -> np.ndarray:
    """`splitmix64` over a uint64 array (numpy integer arrays wrap silently). Does not mutate x."""
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MUL1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MUL2)
    return x ^ (x >> np.uint64(31))


def request_seed_hash(seed: int, sample_index: int) -> int:
    """The step-independent part of a request's noise seed, as a uint64 value."""
    return splitmix64(splitmix64(seed & _MASK64) ^ sample_index)


def step_seeds(request_hashes: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Seeds (int64 in [0, 2**63)) of one step's noise: rows' `request_seed_hash` values (uint64)
    and their step numbers (tokens generated so far). Does not mutate its arguments."""
    mixed = splitmix64_np(request_hashes ^ steps.astype(np.uint64))
    return (mixed >> np.uint64(1)).astype(np.int64)


def _signed(c: int) -> int:
    # A 64-bit constant as the int64 with the same bits (torch integer tensors are signed).
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(x: torch.Tensor, s: int) -> torch.Tensor:
    # Logical shift of int64 bits: `>>` is arithmetic on signed tensors, so mask the sign copies.
    return (x >> s) & ((1 << (64 - s)) - 1)


def seeded_exponential(seeds: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [num_rows, vocab_size] float32 on `seeds`' device, row r a function of
    seeds[r] (int64 [num_rows]) alone. Never 0 and finite (uniforms avoid both ends). Does not
    mutate `seeds`."""
    counters = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * _signed(_GOLDEN)
    x = seeds.unsqueeze(1) + counters  # the SplitMix64 states of tokens 0 .. vocab_size - 1
    x ^= _shift_right(x, 30)
    x *= _signed(_MUL1)
    x ^= _shift_right(x, 27)
    x *= _signed(_MUL2)
    x ^= _shift_right(x, 31)
    uniform = (_shift_right(x, 64 - _UNIFORM_BITS).to(torch.float32) + 0.5) * (2.0**-_UNIFORM_BITS)
    return uniform.log_().neg_()
