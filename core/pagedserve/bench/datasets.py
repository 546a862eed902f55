"""Benchmark requests: random token-id prompts, or a workload file.

A workload file is JSON: a list of `{"prompt_ids": [...], "output_len": N}`, or an object with
that list under "requests" (the format of `shared/workloads/`, which may carry a "meta" object).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int  # tokens to generate (EOS ignored)


def random_requests(
    num: int, *, input_len: int, output_len: int, vocab_size: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """`num` requests of random token ids. With range_ratio r, lengths are drawn uniformly from
    [len * (1 - r), len * (1 + r)] (at least 1)."""
    if num < 1 or input_len < 1 or output_len < 1 or vocab_size < 1:
        raise ValueError("num-prompts, input and output lengths and vocab size must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        low, high = round(mean * (1 - range_ratio)), round(mean * (1 + range_ratio))
        return max(1, rng.randint(low, high))

    return [
        BenchRequest([rng.randrange(vocab_size) for _ in range(length(input_len))], length(output_len))
        for _ in range(num)
    ]


def load_workload(path: str | Path, num: int | None = None) -> list[BenchRequest]:
    """The first `num` requests (all when None) of a workload file. Raises ValueError naming the
    problem when the file does not follow the format."""
    data = json.loads(Path(path).read_text())
    items = data.get("requests") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path}: expected a non-empty list of requests (or an object with 'requests')")
    out = []
    for i, item in enumerate(items[:num] if num is not None else items):
        ids, output_len = item.get("prompt_ids"), item.get("output_len")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError(f"{path}: request {i}: prompt_ids must be a non-empty list of token ids")
        if not isinstance(output_len, int) or output_len < 1:
            raise ValueError(f"{path}: request {i}: output_len must be an int >= 1")
        out.append(BenchRequest(ids, output_len))
    if num is not None and len(out) < num:
        raise ValueError(f"{path} holds {len(out)} requests, fewer than the {num} asked for")
    return out


def fit_vocab(requests: list[BenchRequest], vocab_size: int, *, wrap: bool) -> list[BenchRequest]:
    """Check every token id is below `vocab_size`. With `wrap`, out-of-range ids are mapped to
    `id % vocab_size` (the workload files were made for larger vocabularies); without it, they
    raise ValueError saying to pass --wrap-token-ids."""
    bad = sum(1 for r in requests for t in r.prompt_ids if t >= vocab_size)
    if not bad:
        return requests
    if not wrap:
        raise ValueError(
            f"{bad} prompt token ids are >= the model's vocabulary size ({vocab_size}): "
            "pass --wrap-token-ids to map them to id % vocab_size"
        )
    return [BenchRequest([t % vocab_size for t in r.prompt_ids], r.output_len) for r in requests]
