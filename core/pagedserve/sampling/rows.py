"""`SamplingRows`: the sampling parameters of a persistent batch, one array slot per row.

Rebuilding the sampler's inputs from per-request Python objects every step costs a loop over the
whole batch, and a host-to-device copy per feature, every step. Here a request's parameters are
written into flat arrays once, when it joins (`add`); leaving moves the last row into the hole
(`remove`), exactly as the persistent input batch does, so row r here is row r there.

The arrays are the columns of a `RowTable`, laid out from the parameter declarations: a newly
declared parameter gets its column, and its metadata tensor when declared `metadata=True`,
without a line of this module changing.

`metadata` derives one step's `SamplingMetadata` from the columns with numpy. Each declared
`metadata=True` column becomes the metadata tensor of its name (neutral on greedy rows where only
random rows read it; None when every sampled row holds the neutral value). What depends only
on the rows' parameters (temperatures, top-k/top-p/min-p, penalty weights, logit bias, prompt
histories, seeds' request parts) is cached with its device tensors while the set of rows stays
the same (`version`), which in steady decode is most steps. Only what moves with each token is
rebuilt per step: the seeded rows' step seeds, min_tokens bans, bans of bad words longer than one
token and penalty output histories, and each only when some row uses it. An all-greedy batch with
none of them reuses one cached object.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedserve.sampling.metadata import SamplingMetadata, SeededRows, SparseLogitEdits
from pagedserve.sampling.noise import request_seed_hash, step_seeds
from pagedserve.sampling.penalties import PenaltyTensors
from pagedserve.sampling.row_table import DECLARED, NEUTRAL, RowTable
from pagedserve.sampling.sampling_params import SamplingParams, SamplingType

_RANDOM_ONLY = tuple(name for name, row in DECLARED if row.random_only)  # neutral on greedy rows
_METADATA = tuple(name for name, row in DECLARED if row.metadata)  # a metadata tensor each
# The columns `_build_static` reads through `_values`, the metadata ones and top_k: (column, its
# neutral value, whether greedy rows get it).
_METADATA_READS = tuple((name, NEUTRAL[name], name in _RANDOM_ONLY) for name in (*_METADATA, "top_k"))
# The penalty columns, in PenaltyTensors' order (presence, frequency, repetition).
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
_read_penalties = operator.attrgetter(*_PENALTIES)
_NO_PENALTY = tuple(row.neutral for name, row in DECLARED if name in _PENALTIES)


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
    # declared metadata column -> its tensor (None: every sampled row holds the neutral value)
    per_row: dict[str, Any]
    greedy: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None
    max_top_k: int | None
    top_p_rows: torch.Tensor | None
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
            greedy=self.greedy,
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_k=self.top_k,
            max_top_k=self.max_top_k,
            top_p_rows=self.top_p_rows,
            penalties=penalties,
            logit_edits=logit_edits,
            seeded=seeded,
            generator=generator,
            max_num_logprobs=self.max_num_logprobs,
            **self.per_row,
        )


class SamplingRows:
    """Per-row sampling parameters of a persistent batch. `add`/`remove` mutate; `metadata`
    mutates only its cache."""

    def __init__(self, max_num_rows: int) -> None:
        self.max_num_rows = max_num_rows
        self.params: list[SamplingParams] = []  # row -> params; len == num_rows
        self._table = RowTable(max_num_rows)
        self.columns = self._table.columns  # column -> [max_num_rows]; read only
        self.greedy = self.columns["greedy"]
        self.seeded = self.columns["seeded"]
        self.seed_hash = self.columns["seed_hash"]
        self.wants_logprobs = self.columns["wants_logprobs"]
        self.num_logprobs = self.columns["num_logprobs"]
        self.wants_prompt_logprobs = self.columns["wants_prompt_logprobs"]
        self.has_bias = self.columns["has_bias"]
        self.bad_word_prefixes = self.columns["bad_word_prefixes"]
        self.reads_generated = self.columns["reads_generated"]
        self.version = 0  # bumped by every add/remove: the cache key of the static part
        self._arange = np.arange(max_num_rows, dtype=np.int64)
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
        bad_words = params.bad_words_token_ids
        prefixes = any(len(seq) > 1 for seq in bad_words) if bad_words else False
        seed, logprobs = params.seed, params.logprobs
        derived = (  # in row_table.DERIVED's order
            params.sampling_type is SamplingType.GREEDY,
            seed is not None,
            request_seed_hash(seed, sample_index) if seed is not None else 0,
            logprobs is not None,
            logprobs or 0,
            params.prompt_logprobs is not None,
            bool(params.logit_bias) or params.allowed_token_ids is not None or bool(bad_words),
            prefixes,
            prefixes or _read_penalties(params) != _NO_PENALTY,
        )
        self._table.write(row, params, derived)
        self.version += 1
        return row

    def remove(self, row: int) -> None:
        """Drop a row, moving the last row into its place (as `InputBatch.remove` does)."""
        last = self.num_rows - 1
        if not 0 <= row <= last:
            raise IndexError(f"row {row} is not in use ({self.num_rows} rows)")
        if row != last:
            self.params[row] = self.params[last]
            self._table.move(last, row)
        self.params.pop()
        self.version += 1

    def reads_outputs(self, rows: np.ndarray) -> bool:
        """Whether sampling any of these rows reads its generated tokens: for a penalty, or to
        match a bad word of several tokens. A runner that schedules a row before the host has its
        previous sample must then write that sample into the row's history first. Does not mutate."""
        return bool(self.reads_generated[rows].any())

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
            static = self._build_static(rows, every_row, key, vocab_size, device, generator)
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
        every_row: bool,
        key: tuple[object, ...],
        vocab_size: int,
        device: torch.device,
        generator: torch.Generator | None,
    ) -> _Static:
        def tensor(values: np.ndarray) -> torch.Tensor:
            return _to_device(values, device)

        # Where the columns are read: a slice when every row is sampled once, in order (views,
        # cheaper than gathering), else the rows themselves.
        at: slice | np.ndarray = slice(0, len(rows)) if every_row else rows
        greedy = self.greedy[at]
        random = ~greedy
        num_greedy = int(np.count_nonzero(greedy))
        all_greedy, all_random = num_greedy == len(rows), num_greedy == 0
        values = self._values(at, greedy, all_random)
        per_row: dict[str, Any] = {}
        for name in _METADATA:
            column = values[name]
            per_row[name] = tensor(column) if (column != NEUTRAL[name]).any() else None
        # top_k in the vocabulary's terms: the vocabulary's size where disabled (0), at most it.
        top_k = values["top_k"]
        top_k = np.where(top_k > 0, np.minimum(top_k, vocab_size), vocab_size)
        uses_top_k = top_k < vocab_size
        any_top_k = bool(uses_top_k.any())
        uses_top_p = values["top_p"] != NEUTRAL["top_p"]
        # Sorting a few rows instead of the batch pays for the gather and scatter around it.
        sort_subset = bool(uses_top_p.any()) and 2 * int(uses_top_p.sum()) <= len(rows)
        wants = self._wanted_logprobs(at, vocab_size)
        penalized, penalty_weights = self._penalty_weights(at, len(rows), device)
        bias = self._bias(rows, at, vocab_size)
        seeded_positions = (random & self.seeded[at]).nonzero()[0]
        static = _Static(
            key=key,
            per_row=per_row,
            greedy=None if all_greedy or all_random else tensor(greedy),
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=tensor(top_k) if any_top_k else None,
            max_top_k=int(top_k[uses_top_k].max()) if any_top_k else None,
            top_p_rows=tensor(uses_top_p.nonzero()[0]) if sort_subset else None,
            max_num_logprobs=int(wants.max()) if wants.size else None,
            penalty_weights=penalty_weights,
            penalty_positions=penalized.nonzero()[0],
            prompt_ids=None,
            bias=bias,
            bias_edits=_edits(*bias, device) if bias[0].size else None,
            min_tokens_positions=(self.columns["min_tokens"][at] > 0).nonzero()[0],
            bad_word_positions=self.bad_word_prefixes[at].nonzero()[0],
            seeded_positions=seeded_positions,
            seeded_rows=tensor(seeded_positions) if seeded_positions.size else None,
            seed_hashes=self.seed_hash[at][seeded_positions],
            fixed=None,
        )
        per_step = static.min_tokens_positions.size or static.bad_word_positions.size or seeded_positions.size
        if penalty_weights is None and not per_step:
            static.fixed = static.assemble(len(rows), vocab_size, generator, None, static.bias_edits, None)
        return static

    def _values(self, at: slice | np.ndarray, greedy: np.ndarray, all_random: bool) -> dict[str, np.ndarray]:
        """column -> its values at `at` (possibly views of the columns: read, never write them)
        for the columns the metadata reads. Greedy rows (the mask `greedy`) hold the neutral value
        in those only random rows read, so that the random path can run over the whole batch."""
        out = {}
        for name, neutral, random_only in _METADATA_READS:
            values = self.columns[name][at]
            if random_only and not all_random:
                values = np.where(greedy, neutral, values)
            out[name] = values
        return out

    def _wanted_logprobs(self, at: slice | np.ndarray, vocab_size: int) -> np.ndarray:
        """The numbers of top logprobs asked for by the rows at `at` that want logprobs; raises if
        one asks for more than the vocabulary has, since no token could fill the surplus."""
        wants = self.num_logprobs[at][self.wants_logprobs[at]]
        if wants.size and int(wants.max()) > vocab_size:
            raise ValueError(
                f"logprobs={int(wants.max())} asks for more top tokens than the vocabulary has ({vocab_size})"
            )
        return wants

    def _penalty_weights(
        self, at: slice | np.ndarray, num_positions: int, device: torch.device
    ) -> tuple[np.ndarray, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        """The mask of the penalized rows at `at` and their (presence, frequency, repetition) weights on
        `device`, or None for the weights when no row is penalized (the step skips penalties)."""
        presence, frequency, repetition = (self.columns[name][at] for name in _PENALTIES)
        penalized = np.zeros(num_positions, dtype=bool)
        for name, values in zip(_PENALTIES, (presence, frequency, repetition), strict=True):
            penalized |= values != NEUTRAL[name]
        if not penalized.any():
            return penalized, None
        weights = (
            _to_device(presence, device),
            _to_device(frequency, device),
            _to_device(repetition, device),
        )
        return penalized, weights

    def _bias(
        self, rows: np.ndarray, at: slice | np.ndarray, vocab_size: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Logit bias, for rows with allowed_token_ids a -inf ban of every other token, and a -inf
        ban of every one-token bad word (built when the batch changes, not per step). `rows` are
        the sampled positions' rows, `at` where their columns are read (`_build_static`)."""
        positions: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        bans: list[tuple[int, np.ndarray]] = []  # (position, banned token ids)
        for position in np.nonzero(self.has_bias[at])[0].tolist():
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
            candidates = candidates[num_outputs[candidates] < self.columns["min_tokens"][rows[candidates]]]
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
            weights = self.columns["repetition_penalty"][histories.rows[positions]]
            with_repetition = positions[weights != NEUTRAL["repetition_penalty"]]
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
    """`values` as a tensor on `device`, sharing no memory with the rows' table: a view of a column
    is copied (from_numpy shares memory, and so does `.to` a CPU device, so a cached tensor
    would change with the table)."""
    own = values if values.flags.owndata and values.flags.c_contiguous else np.array(values)
    return torch.from_numpy(own).to(device)


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
