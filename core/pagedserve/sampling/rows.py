"""`SamplingRows`: the sampling parameters of a persistent batch, one array slot per row.

Rebuilding the sampler's inputs from per-request Python objects every step costs a loop over the
whole batch, and a host-to-device copy per feature, every step. Here a request's parameters are
written into flat arrays once, when it joins (`add`); leaving moves the last row into the hole
(`remove`), exactly as the persistent input batch does, so row r here is row r there.

`metadata` derives one step's `SamplingMetadata` from the arrays with numpy. What depends only
on the rows' parameters (temperatures, top-k/top-p/min-p, penalty weights, logit bias, prompt
histories, seeds' request parts) is cached with its device tensors while the set of rows stays
the same (`version`), which in steady decode is most steps. Only what moves with each token is
rebuilt per step: the seeded rows' step seeds, min_tokens bans, bans of bad words longer than one
token and penalty output histories, and each only when some row uses it. An all-greedy batch with
none of them reuses one cached object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.sampling.metadata import SamplingMetadata, SeededRows, SparseLogitEdits
from pagedserve.sampling.noise import request_seed_hash, step_seeds
from pagedserve.sampling.penalties import PenaltyTensors
from pagedserve.sampling.sampling_params import SamplingParams, SamplingType


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """One row of a batch, as the builder sees it. Sequences are read, never mutated."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the step index of seeded noise
    sample_index: int = 0  # which of the request's n samples this row is (seeded samples must differ)


@dataclass(frozen=True, slots=True)
class TokenHistories:
    """Where the sampler finds the tokens before each sampled position: rows of a token array.

    A sampled position's history is `token_ids[rows[i], :num_known[i]]`, its prompt the first
    `num_prompt[i]` of those, its outputs the rest (drafts scored before it included)."""

    token_ids: np.ndarray  # [num_rows, max_len] int64; the persistent batch's token array
    rows: np.ndarray  # [num_positions] int64; row of each sampled position
    num_prompt: np.ndarray  # [num_positions] int64; prompt length of that row
    num_known: np.ndarray  # [num_positions] int64; tokens before the sampled position

    @staticmethod
    def from_lists(prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> TokenHistories:
        """Histories of one position per row i, from prompt and output lists. Does not mutate."""
        num_prompt = np.array([len(p) for p in prompts], dtype=np.int64)
        num_known = num_prompt + np.array([len(o) for o in outputs], dtype=np.int64)
        token_ids = np.zeros((len(prompts), int(num_known.max(initial=0))), dtype=np.int64)
        for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            token_ids[row, : len(prompt)] = prompt
            token_ids[row, len(prompt) : num_known[row]] = output
        return TokenHistories(token_ids, np.arange(len(prompts), dtype=np.int64), num_prompt, num_known)


@dataclass(slots=True)
class _Static:
    """The part of the metadata that depends only on which rows are sampled, for one batch shape."""

    key: tuple[object, ...]  # (version, vocab_size, device, generator) it was built for
    temperature: torch.Tensor | None
    greedy: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    max_top_k: int | None
    top_p: torch.Tensor | None
    top_p_rows: torch.Tensor | None
    min_p: torch.Tensor | None
    max_num_logprobs: int | None
    # Penalties: None when no position has one.
    penalty_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # presence, frequency, repetition
    penalty_positions: np.ndarray  # positions with any penalty (their output history is sent)
    prompt_ids: torch.Tensor | None  # [num_positions, width] prompts of repetition-penalty rows
    # Logit bias and one-token bad words (fixed), and the rows that may need min_tokens or
    # bad-word bans (per step).
    bias: tuple[np.ndarray, np.ndarray, np.ndarray]  # positions, token ids, values
    bias_edits: SparseLogitEdits | None  # `bias` on the device; None when empty
    min_tokens_positions: np.ndarray  # positions whose request has min_tokens > 0
    bad_word_positions: np.ndarray  # positions whose request has a bad word of several tokens
    # Seeded random positions and their step-independent seed parts (uint64).
    seeded_positions: np.ndarray
    seeded_rows: torch.Tensor | None
    seed_hashes: np.ndarray
    # The whole metadata when nothing in it changes from step to step.
    fixed: SamplingMetadata | None

    def assemble(
        self,
        num_positions: int,
        vocab_size: int,
        generator: torch.Generator | None,
        penalties: PenaltyTensors | None,
        logit_edits: SparseLogitEdits | None,
        seeded: SeededRows | None,
    ) -> SamplingMetadata:
        """The metadata of a step: these fixed parts plus the given per-step ones."""
        return SamplingMetadata(
            num_reqs=num_positions,
            vocab_size=vocab_size,
            temperature=self.temperature,
            greedy=self.greedy,
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_k=self.top_k,
            max_top_k=self.max_top_k,
            top_p=self.top_p,
            top_p_rows=self.top_p_rows,
            min_p=self.min_p,
            penalties=penalties,
            logit_edits=logit_edits,
            seeded=seeded,
            generator=generator,
            max_num_logprobs=self.max_num_logprobs,
        )


class SamplingRows:
    """Per-row sampling parameters of a persistent batch. `add`/`remove` mutate; `metadata`
    mutates only its cache."""

    def __init__(self, max_num_rows: int) -> None:
        self.max_num_rows = max_num_rows
        self.params: list[SamplingParams] = []  # row -> params; len == num_rows
        n = max_num_rows
        self.greedy = np.zeros(n, dtype=bool)
        self.temperature = np.ones(n, dtype=np.float32)  # raw; greedy rows are neutralised later
        self.top_k = np.zeros(n, dtype=np.int64)  # SamplingParams' value: 0 disables
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.presence = np.zeros(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.repetition = np.ones(n, dtype=np.float32)
        self.seeded = np.zeros(n, dtype=bool)
        self.seed_hash = np.zeros(n, dtype=np.uint64)  # request_seed_hash; meaningful where seeded
        self.wants_logprobs = np.zeros(n, dtype=bool)
        self.num_logprobs = np.zeros(n, dtype=np.int64)  # 0 where not wanted
        self.wants_prompt_logprobs = np.zeros(n, dtype=bool)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.has_bias = np.zeros(n, dtype=bool)  # logit bias, allowed_token_ids or bad words
        self.bad_word_prefixes = np.zeros(n, dtype=bool)  # a bad word of several tokens
        self._arrays = [
            self.greedy,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.presence,
            self.frequency,
            self.repetition,
            self.seeded,
            self.seed_hash,
            self.wants_logprobs,
            self.num_logprobs,
            self.wants_prompt_logprobs,
            self.min_tokens,
            self.has_bias,
            self.bad_word_prefixes,
        ]
        self.version = 0  # bumped by every add/remove: the cache key of the static part
        self._arange = np.arange(n, dtype=np.int64)
        self._static: _Static | None = None

    @property
    def num_rows(self) -> int:
        return len(self.params)

    def add(self, params: SamplingParams, sample_index: int) -> int:
        """Append a row for a request's params (`sample_index`: which of its n samples); returns
        the row. Raises RuntimeError when all rows are taken."""
        row = self.num_rows
        if row >= self.max_num_rows:
            raise RuntimeError(f"all {self.max_num_rows} sampling rows are taken")
        self.params.append(params)
        self.greedy[row] = params.sampling_type is SamplingType.GREEDY
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.seeded[row] = params.seed is not None
        self.seed_hash[row] = request_seed_hash(params.seed, sample_index) if params.seed is not None else 0
        self.wants_logprobs[row] = params.logprobs is not None
        self.num_logprobs[row] = params.logprobs or 0
        self.wants_prompt_logprobs[row] = params.prompt_logprobs is not None
        self.min_tokens[row] = params.min_tokens
        bad_words = params.bad_words_token_ids
        self.has_bias[row] = bool(params.bias) or params.allowed_token_ids is not None or bool(bad_words)
        self.bad_word_prefixes[row] = any(len(seq) > 1 for seq in bad_words)
        self.version += 1
        return row

    def remove(self, row: int) -> None:
        """Drop a row, moving the last row into its place (as `InputBatch.remove` does)."""
        last = self.num_rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not in use ({self.num_rows} rows)")
        if row != last:
            self.params[row] = self.params[last]
            for array in self._arrays:
                array[row] = array[last]
        self.params.pop()
        self.version += 1

    def reads_outputs(self, rows: np.ndarray) -> bool:
        """Whether sampling any of these rows reads its generated tokens: for a penalty, or to
        match a bad word of several tokens. A runner that schedules a row before the host has its
        previous sample must then write that sample into the row's history first. Does not mutate."""
        return bool(
            (self.presence[rows] != 0).any()
            or (self.frequency[rows] != 0).any()
            or (self.repetition[rows] != 1).any()
            or self.bad_word_prefixes[rows].any()
        )

    # ---- one step ----------------------------------------------------------------------------

    def metadata(
        self,
        histories: TokenHistories,
        *,
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> SamplingMetadata:
        """This step's metadata for the sampled positions `histories.rows` (several positions may
        share a row when drafts are scored). Raises ValueError for token ids outside
        [0, vocab_size) (logit bias, stop ids, bad words, penalty histories) or logprobs >
        vocab_size."""
        rows = histories.rows  # a row per sampled position
        n = len(rows)
        if n == 0:
            raise ValueError("cannot build sampling metadata for an empty batch")
        key = (self.version, vocab_size, device, generator)
        every_row = n == self.num_rows and bool((rows == self._arange[:n]).all())
        static = self._static
        if static is None or static.key != key or not every_row:
            static = self._build_static(rows, key, vocab_size, device, generator)
            # Only the plain every-row-once layout repeats from step to step.
            self._static = static if every_row else None
        if static.fixed is not None:
            return static.fixed
        num_outputs = histories.num_known - histories.num_prompt
        seeded = None
        if static.seeded_rows is not None:
            seeds = step_seeds(static.seed_hashes, num_outputs[static.seeded_positions])
            seeded = SeededRows(static.seeded_rows, torch.from_numpy(seeds).to(device))
        return static.assemble(
            n,
            vocab_size,
            generator,
            self._penalties(static, histories, vocab_size, device),
            self._logit_edits(static, histories, num_outputs, vocab_size, eos_token_id, device),
            seeded,
        )

    def _build_static(
        self,
        rows: np.ndarray,
        key: tuple[object, ...],
        vocab_size: int,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> _Static:
        def tensor(values: np.ndarray) -> torch.Tensor:
            return _to_device(values, device)

        greedy = self.greedy[rows]
        random = ~greedy
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        top_k, top_p, min_p, temperature = self._filter_values(rows, greedy, vocab_size)
        uses_top_k = top_k < vocab_size
        uses_top_p = top_p != 1.0
        # Sorting a few rows instead of the batch pays for the gather and scatter around it.
        sort_subset = bool(uses_top_p.any()) and 2 * int(uses_top_p.sum()) <= len(rows)
        wants = self._wanted_logprobs(rows, vocab_size)
        penalized, penalty_weights = self._penalty_weights(rows, device)
        bias = self._bias(rows, vocab_size)
        seeded_positions = np.nonzero(random & self.seeded[rows])[0]
        static = _Static(
            key=key,
            temperature=None if all_greedy else tensor(temperature),
            greedy=None if all_greedy or all_random else tensor(greedy),
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=tensor(top_k) if uses_top_k.any() else None,
            max_top_k=int(top_k[uses_top_k].max()) if uses_top_k.any() else None,
            top_p=tensor(top_p) if uses_top_p.any() else None,
            top_p_rows=tensor(np.nonzero(uses_top_p)[0]) if sort_subset else None,
            min_p=tensor(min_p) if (min_p != 0.0).any() else None,
            max_num_logprobs=int(wants.max()) if wants.size else None,
            penalty_weights=penalty_weights,
            penalty_positions=np.nonzero(penalized)[0],
            prompt_ids=None,
            bias=bias,
            bias_edits=_edits(*bias, device) if bias[0].size else None,
            min_tokens_positions=np.nonzero(self.min_tokens[rows] > 0)[0],
            bad_word_positions=np.nonzero(self.bad_word_prefixes[rows])[0],
            seeded_positions=seeded_positions,
            seeded_rows=tensor(seeded_positions) if seeded_positions.size else None,
            seed_hashes=self.seed_hash[rows][seeded_positions],
            fixed=None,
        )
        per_step = static.min_tokens_positions.size or static.bad_word_positions.size or seeded_positions.size
        if penalty_weights is None and not per_step:
            static.fixed = static.assemble(len(rows), vocab_size, generator, None, static.bias_edits, None)
        return static

    def _filter_values(
        self, rows: np.ndarray, greedy: np.ndarray, vocab_size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(top_k, top_p, min_p, temperature) of `rows`, each [len(rows)]; greedy rows (the mask
        `greedy`) get neutral values so that the random path can run over the whole batch."""
        random = ~greedy
        top_k = np.where(
            random & (self.top_k[rows] > 0), np.minimum(self.top_k[rows], vocab_size), vocab_size
        )
        top_p = np.where(random, self.top_p[rows], np.float32(1.0))
        min_p = np.where(random, self.min_p[rows], np.float32(0.0))
        temperature = np.where(greedy, np.float32(1.0), self.temperature[rows])
        return top_k, top_p, min_p, temperature

    def _wanted_logprobs(self, rows: np.ndarray, vocab_size: int) -> np.ndarray:
        """The numbers of top logprobs asked for by those of `rows` that want logprobs; raises if
        one asks for more than the vocabulary has, since no token could fill the surplus."""
        wants = self.num_logprobs[rows][self.wants_logprobs[rows]]
        if wants.size and int(wants.max()) > vocab_size:
            raise ValueError(
                f"logprobs={int(wants.max())} asks for more top tokens than the vocabulary has ({vocab_size})"
            )
        return wants

    def _penalty_weights(
        self, rows: np.ndarray, device: torch.device
    ) -> tuple[np.ndarray, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """The mask of penalized `rows` and their (presence, frequency, repetition) weights on
        `device`, or None for the weights when no row is penalized (the step skips penalties)."""
        presence, frequency, repetition = self.presence[rows], self.frequency[rows], self.repetition[rows]
        penalized = (presence != 0) | (frequency != 0) | (repetition != 1)
        if not penalized.any():
            return penalized, None
        weights = (
            _to_device(presence, device),
            _to_device(frequency, device),
            _to_device(repetition, device),
        )
        return penalized, weights

    def _bias(self, rows: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Logit bias, for rows with allowed_token_ids a -inf ban of every other token, and a -inf
        ban of every one-token bad word (built when the batch changes, not per step)."""
        positions: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        bans: list[tuple[int, np.ndarray]] = []  # (position, banned token ids)
        for position in np.nonzero(self.has_bias[rows])[0].tolist():
            params = self.params[int(rows[position])]
            for token, value in params.bias.items():
                positions.append(position)
                tokens.append(token)
                values.append(value)
            if params.allowed_token_ids is not None:
                allowed = np.asarray(params.allowed_token_ids, dtype=np.int64)
                _check_vocab(allowed.tolist(), vocab_size)
                bans.append((position, np.setdiff1d(np.arange(vocab_size, dtype=np.int64), allowed)))
            single = [seq[0] for seq in params.bad_words_token_ids if len(seq) == 1]
            if single:
                _check_vocab(single, vocab_size)
                bans.append((position, np.array(single, dtype=np.int64)))
        _check_vocab(tokens, vocab_size)
        out_positions = [np.array(positions, dtype=np.int64)]
        out_tokens = [np.array(tokens, dtype=np.int64)]
        out_values = [np.array(values, dtype=np.float32)]
        for position, banned in bans:
            out_positions.append(np.full(banned.size, position, dtype=np.int64))
            out_tokens.append(banned)
            out_values.append(np.full(banned.size, -np.inf, dtype=np.float32))
        return np.concatenate(out_positions), np.concatenate(out_tokens), np.concatenate(out_values)

    def _logit_edits(
        self,
        static: _Static,
        histories: TokenHistories,
        num_outputs: np.ndarray,  # [num_positions] tokens generated before each sampled position
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device,
    ) -> SparseLogitEdits | None:
        """The fixed edits (`static.bias`) plus this step's -inf bans: min_tokens' and bad words'."""
        rows = histories.rows
        positions: list[int] = []  # one entry per ban
        tokens: list[int] = []
        candidates = static.min_tokens_positions
        if candidates.size:
            candidates = candidates[num_outputs[candidates] < self.min_tokens[rows[candidates]]]
        for position in candidates.tolist():
            # Until min_tokens are generated, nothing that would end the request may be sampled.
            params = self.params[int(rows[position])]
            banned = set(params.stop_ids)
            if eos_token_id is not None and not params.ignore_eos:
                banned.add(eos_token_id)
            for token in sorted(banned):
                positions.append(position)
                tokens.append(token)
        for position in static.bad_word_positions.tolist():
            for token in self._bad_word_ends(histories, position):
                positions.append(position)
                tokens.append(token)
        if not positions:
            return static.bias_edits
        _check_vocab(tokens, vocab_size)
        fixed_positions, fixed_tokens, fixed_values = static.bias
        return _edits(
            np.concatenate([fixed_positions, np.array(positions, dtype=np.int64)]),
            np.concatenate([fixed_tokens, np.array(tokens, dtype=np.int64)]),
            np.concatenate([fixed_values, np.full(len(tokens), -np.inf, dtype=np.float32)]),
            device,
        )

    def _bad_word_ends(self, histories: TokenHistories, position: int) -> list[int]:
        """The last tokens of the several-token bad words whose other tokens end the outputs
        generated before sampled `position` (vLLM's rule: the prompt is not searched)."""
        row = int(histories.rows[position])
        sequences = self.params[row].bad_words_token_ids
        start, end = int(histories.num_prompt[position]), int(histories.num_known[position])
        longest = max(len(seq) for seq in sequences) - 1
        tail = tuple(histories.token_ids[row, max(start, end - longest) : end].tolist())
        return [
            seq[-1]
            for seq in sequences
            if 1 < len(seq) <= len(tail) + 1 and tail[len(tail) - len(seq) + 1 :] == seq[:-1]
        ]

    def _penalties(
        self, static: _Static, histories: TokenHistories, vocab_size: int, device: torch.device
    ) -> PenaltyTensors | None:
        if static.penalty_weights is None:
            return None
        presence, frequency, repetition = static.penalty_weights
        positions = static.penalty_positions
        if static.prompt_ids is None:
            # The prompt part never changes for a row: built once per static part.
            with_repetition = positions[self.repetition[histories.rows[positions]] != 1]
            static.prompt_ids = _padded_histories(
                histories,
                with_repetition,
                np.zeros_like(histories.num_prompt),
                histories.num_prompt,
                vocab_size,
                device,
                "prompt token",
            )
        outputs = _padded_histories(
            histories,
            positions,
            histories.num_prompt,
            histories.num_known,
            vocab_size,
            device,
            "output token",
        )
        return PenaltyTensors(presence, frequency, repetition, static.prompt_ids, outputs)

    def __repr__(self) -> str:
        return f"SamplingRows({self.num_rows}/{self.max_num_rows} rows, version {self.version})"


def _padded_histories(
    histories: TokenHistories,
    positions: np.ndarray,  # the sampled positions whose history is wanted; others get none
    starts: np.ndarray,  # [num_positions] first column of each position's slice
    ends: np.ndarray,  # [num_positions] one past its last column
    vocab_size: int,
    device: torch.device,
    what: str,
) -> torch.Tensor:
    """[num_positions, width] int64 on `device`: each wanted position's tokens
    `token_ids[row, start:end]`, right-padded with vocab_size (see penalties.py). Raises
    ValueError naming the position for an id outside [0, vocab_size)."""
    num = len(histories.rows)
    lengths = (ends - starts)[positions]
    width = int(lengths.max(initial=0))
    out = np.full((num, width), vocab_size, dtype=np.int64)
    if width:
        columns = starts[positions, None] + np.arange(width)
        valid = columns < ends[positions, None]
        last = histories.token_ids.shape[1] - 1
        values = histories.token_ids[histories.rows[positions, None], np.minimum(columns, last)]
        bad = valid & ((values < 0) | (values >= vocab_size))
        if bad.any():
            i, j = (int(x[0]) for x in np.nonzero(bad))
            raise ValueError(
                f"row {int(positions[i])}: {what} ids must be in [0, {vocab_size}), got {int(values[i, j])}"
            )
        out[positions] = np.where(valid, values, vocab_size)
    return torch.from_numpy(out).to(device)


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device` (from_numpy needs a contiguous array)."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)


def _check_vocab(tokens: list[int], vocab_size: int) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias / stop_token_ids / allowed_token_ids / bad_words hold token ids outside the "
            f"vocabulary [0, {vocab_size}): {bad[:8]}"
        )


def _edits(
    positions: np.ndarray, tokens: np.ndarray, values: np.ndarray, device: torch.device
) -> SparseLogitEdits:
    return SparseLogitEdits(
        rows=torch.from_numpy(positions).to(device),
        token_ids=torch.from_numpy(tokens).to(device),
        values=torch.from_numpy(values).to(device),
    )


def build_sampling_metadata(
    requests: Sequence[SamplingRequest],
    *,
    vocab_size: int,
    eos_token_id: int | None,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> SamplingMetadata:
    """Build the metadata of one step for `requests` (row i = requests[i]) from scratch; tensors
    go to `device`, which must be the device of the logits given to the sampler.

    Raises ValueError when a logit-bias, stop, bad-word or history token id is outside [0, vocab_size)
    or logprobs exceeds vocab_size. Does not mutate its arguments."""
    if not requests:
        raise ValueError("cannot build sampling metadata for an empty batch")
    rows = SamplingRows(len(requests))
    for r in requests:
        rows.add(r.params, r.sample_index)
    histories = TokenHistories.from_lists(
        [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests]
    )
    return rows.metadata(
        histories,
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        device=torch.device(device),
        generator=generator,
    )
