"""Offline beam search on top of the engine, with vLLM's names (`LLM.beam_search`,
`BeamSearchParams`, `BeamSearchSequence`, `BeamSearchOutput`).

Every step extends each live beam by one token: all live beams of all prompts go to the engine as
one batch of prompts (the prompt plus the beam's tokens) with `max_tokens=1` and
`logprobs=2 * beam_width`. Each beam's returned top tokens become candidates; a candidate ending in
EOS (unless `ignore_eos`) moves to the prompt's completed list, the others compete for the
`beam_width` live places by length-penalised cumulative logprob. After `max_tokens` steps (or when
no beam is live) the completed and live beams of each prompt are ranked the same way and the best
`beam_width` returned.

Beams re-send their whole sequence each step; the prefix cache keeps the KV blocks of the full
blocks they share (with the prompt, with each other, with the previous step), so a step computes
little more than each beam's last block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from numbers import Real

from pagedserve.outputs import FinishReason, Logprob, RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams

RunBatch = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]
"""Runs token-id prompts to completion under one `SamplingParams`; one output per prompt, in order."""

Decode = Callable[[list[int]], str]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Options of `LLM.beam_search` (vLLM's fields and defaults). Out-of-range values raise
    ValueError naming the field."""

    beam_width: int  # >= 1: live beams kept per prompt, and sequences returned per prompt
    max_tokens: int  # >= 1: tokens generated per beam (fewer when it ends in EOS)
    ignore_eos: bool = False  # True: EOS is a token like any other and ends no beam
    temperature: float = 0.0  # >= 0: the sampled token (one more candidate per beam) is drawn at it
    length_penalty: float = 1.0  # score = cum_logprob / len(tokens) ** length_penalty
    include_stop_str_in_output: bool = False  # keep a final EOS token's text in `text`

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite float >= 0, got {self.temperature!r}")
        if not _is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite float, got {self.length_penalty!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam. As in vLLM, `tokens` holds the prompt's tokens followed by the generated ones,
    and `text` decodes all of them."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # one dict per generated token
    cum_logprob: float = 0.0  # sum of the generated tokens' logprobs
    text: str | None = None  # filled when returned; None without a tokenizer
    finish_reason: FinishReason | None = None  # "stop" (ended in EOS) or "length" (max_tokens)
    stop_reason: int | str | None = None  # always None: EOS is not a stop token id


@dataclass(slots=True)
class BeamSearchOutput:
    """The result for one prompt: up to `beam_width` sequences, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(
    tokens: Sequence[int], cum_logprob: float, eos_token_ids: Collection[int], length_penalty: float
) -> float:
    """vLLM's ranking: the cumulative logprob over the sequence length (prompt included, a final
    EOS not counted) to the power `length_penalty`. Pure."""
    length = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        length -= 1
    return cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    """The search itself, apart from how a step's batch runs: `batch()` gives the token-id prompts
    of the next step (empty once done) and `step_params` their parameters; `advance` takes their
    outputs, in order; `results()` ranks what was found. The offline `LLM` and the server drive it
    the same way, one synchronously, one on the event loop. Mutated by `advance`."""

    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: Collection[int]
    ) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        width = params.beam_width
        self.step_params = SamplingParams(
            n=1,
            temperature=params.temperature,
            max_tokens=1,
            logprobs=2 * width,  # enough that width non-EOS candidates remain after EOS ones leave
            ignore_eos=True,  # the step's one token is all we read; EOS is judged here
            detokenize=False,  # per-step text is never read: the sequences are decoded once at the end
        )
        self._live: list[list[BeamSearchSequence]] = [[BeamSearchSequence(tokens=list(p))] for p in prompts]
        self._completed: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._steps = 0

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(
            beam.tokens, beam.cum_logprob, self.eos_token_ids, self.params.length_penalty
        )

    def batch(self) -> list[list[int]]:
        """Every live beam's tokens, prompt by prompt; empty once `max_tokens` steps ran or no
        beam is live."""
        if self._steps >= self.params.max_tokens:
            return []
        return [beam.tokens for beams in self._live for beam in beams]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Extend the beams by one step: `outputs` are the engine's, one per `batch()` prompt."""
        params = self.params
        batch_outputs = iter(outputs)
        for i, beams in enumerate(self._live):
            candidates: list[BeamSearchSequence] = []
            for beam in beams:
                logprobs = next(batch_outputs).outputs[0].logprobs
                assert logprobs, "the engine returned no logprobs for a beam step"
                top = logprobs[0]
                for token, logprob in top.items():
                    new = BeamSearchSequence(
                        tokens=[*beam.tokens, token],
                        logprobs=[*beam.logprobs, top],
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                    )
                    if token in self.eos_token_ids and not params.ignore_eos:
                        new.finish_reason = "stop"
                        self._completed[i].append(new)
                    else:
                        candidates.append(new)
            self._live[i] = sorted(candidates, key=self._score, reverse=True)[: params.beam_width]
        self._steps += 1

    def results(self, decode: Decode | None) -> list[BeamSearchOutput]:
        """Each prompt's best `beam_width` sequences, completed and live ranked together, best
        first; `text` decoded when `decode` is given (CPU work as long as the sequences)."""
        params = self.params
        results = []
        for done, beams in zip(self._completed, self._live, strict=True):
            for beam in beams:
                beam.finish_reason = "length"
            best = sorted([*done, *beams], key=self._score, reverse=True)[: params.beam_width]
            if decode is not None:
                for beam in best:
                    ends_in_eos = beam.finish_reason == "stop"
                    keep = (
                        beam.tokens
                        if params.include_stop_str_in_output or not ends_in_eos
                        else beam.tokens[:-1]
                    )
                    beam.text = decode(keep)
            results.append(BeamSearchOutput(sequences=best))
        return results


def run_beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    run_batch: RunBatch,
    eos_token_ids: Collection[int],
    decode: Decode | None,
) -> list[BeamSearchOutput]:
    """Beam search for each token-id prompt, one `run_batch` call per step for all live beams;
    one `BeamSearchOutput` per prompt, in input order."""
    search = BeamSearch(prompts, params, eos_token_ids)
    while batch := search.batch():
        search.advance(run_batch(batch, search.step_params))
    return search.results(decode)
