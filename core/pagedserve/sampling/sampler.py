"""The batched sampler: one set of tensor ops turns a batch of logits into one token per request.

Pipeline, for all rows at once (all on the logits' device):
  1. raw logprobs (if any row asked): log_softmax of the untouched logits;
  2. logit bias, min_tokens and bad-word bans (sparse edits), then repetition/frequency/presence
     penalties, then the grammar bitmask of structured outputs (one masked fill for the batch);
  3. greedy rows: argmax of the processed logits (exactly torch.argmax, ties to the lowest id,
     through `first_argmax`, which spreads a wide row over many parallel reductions);
  4. random rows: divide by temperature, then top-k, top-p and min-p (HF's order; min-p commutes
     with the other two), softmax, and draw by the exponential race: argmax(p_i / E_i) with
     E_i ~ Exp(1) selects token i with probability p_i (the argmax again through `first_argmax`).
     The noise E of a seeded row is a function of `step_seed(seed, sample, step)` alone
     (noise.py), so its tokens do not depend on which other requests share the batch or on its
     row; unseeded rows share one generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sampling.argmax import first_argmax
from pagedserve.sampling.grammar_mask import apply_token_bitmask
from pagedserve.sampling.logprobs import LogprobsTensors, gather_logprobs
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.noise import seeded_exponential
from pagedserve.sampling.penalties import apply_penalties

# Exponential noise is almost never exactly 0, but one 0 would make p / E infinite for a zero-prob token.
_MIN_NOISE = 1e-20


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64, on the logits' device
    logprobs: LogprobsTensors | None  # column 0 is the sampled token; None unless a row wants logprobs


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int | None = None
) -> None:
    """Set to -inf every logit outside each row's top-k and then outside its top-p nucleus.

    top-k keeps every token whose logit ties with the k-th largest (as HF does); top-p keeps the
    smallest set of most likely tokens whose probability (after top-k) reaches top_p, and always
    the most likely token. logits: [num_reqs, vocab]; top_k: [num_reqs] int64 in [1, vocab];
    top_p: [num_reqs] float32 in (0, 1]; max_top_k: the largest top_k below vocab, known on the
    host, which lets top-k alone use torch.topk instead of a full sort (rows whose top_k exceeds
    it must have top-k disabled, k == vocab). Mutates `logits`."""
    if top_k is None and top_p is None:
        return
    vocab = logits.shape[1]
    if top_p is None and top_k is not None and max_top_k is not None and max_top_k < vocab:
        largest = logits.topk(max_top_k, dim=-1).values
        kth_largest = largest.gather(1, (top_k - 1).clamp(max=max_top_k - 1).unsqueeze(1))
        # Rows with top-k disabled (k == vocab) are above max_top_k and keep every token.
        keep_all = (top_k > max_top_k).unsqueeze(1)
        kth_largest = kth_largest.masked_fill(keep_all, float("-inf"))
        logits.masked_fill_(logits < kth_largest, float("-inf"))
        return
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth_largest = ascending.gather(1, (vocab - top_k).unsqueeze(1))
        ascending.masked_fill_(ascending < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        # Tokens whose cumulative mass from the bottom stays within 1 - top_p are outside the nucleus.
        outside = cumulative <= (1.0 - top_p).unsqueeze(1)
        outside[:, -1] = False
        ascending.masked_fill_(outside, float("-inf"))
    logits.scatter_(1, order, ascending)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Set to -inf every logit whose probability is below min_p times the row's largest probability.
    logits: [num_reqs, vocab]; min_p: [num_reqs] float32 in [0, 1]. Mutates `logits`."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def exponential_noise(shape: tuple[int, int], meta: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [num_reqs, vocab]: seeded rows from their step seeds (`noise.py`), the others
    from the shared generator. Does not mutate `meta` (the shared generator's state advances)."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    noise.exponential_(generator=meta.generator)
    if meta.seeded is not None:
        noise.index_copy_(0, meta.seeded.rows, seeded_exponential(meta.seeded.seeds, shape[1]))
    return noise.clamp_min_(_MIN_NOISE)


class Sampler:
    """Stateless; `forward` does not mutate the logits it is given."""

    def __init__(self, fused_grammar_mask: bool = True) -> None:
        # False: grammar bitmasks are applied with plain tensor ops instead of xgrammar's kernel
        # (for debugging; both give the same logits).
        self.fused_grammar_mask = fused_grammar_mask

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row. logits: [num_reqs, vocab_size], float32 (other float dtypes are
        converted first)."""
        if logits.dim() != 2 or logits.shape != (meta.num_reqs, meta.vocab_size):
            raise ValueError(
                f"logits must be [num_reqs={meta.num_reqs}, vocab_size={meta.vocab_size}], "
                f"got {tuple(logits.shape)}"
            )
        logits = logits.to(torch.float32)
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = self._process(logits, meta, self.fused_grammar_mask)
        if meta.all_greedy:
            sampled = first_argmax(processed)
        elif meta.all_random:
            sampled = self._sample_random(processed, meta)
        else:
            assert meta.greedy is not None  # set whenever greedy and random rows are mixed
            sampled = torch.where(meta.greedy, first_argmax(processed), self._sample_random(processed, meta))
        logprobs = None
        if raw_logprobs is not None and meta.max_num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    __call__ = forward

    @staticmethod
    def _process(logits: torch.Tensor, meta: SamplingMetadata, fused_mask: bool) -> torch.Tensor:
        """Logit edits, penalties, then the grammar bitmask, on a copy (the caller's logits stay
        untouched)."""
        if meta.logit_edits is None and meta.penalties is None and meta.token_bitmask is None:
            return logits
        out = logits.clone()
        if meta.logit_edits is not None:
            edits = meta.logit_edits
            out.index_put_((edits.rows, edits.token_ids), edits.values, accumulate=True)
        if meta.penalties is not None:
            apply_penalties(out, meta.penalties)
        if meta.token_bitmask is not None:
            apply_token_bitmask(out, meta.token_bitmask, fused=fused_mask)
        return out

    @staticmethod
    def _sample_random(processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        # A fresh tensor either way, safe to edit in place (`processed` may be the caller's
        # logits); no temperature tensor means every random row's is 1.
        temperature = meta.temperature
        scaled = processed.clone() if temperature is None else processed / temperature.unsqueeze(1)
        if meta.top_p_rows is None or meta.top_p is None:
            apply_top_k_top_p(scaled, meta.top_k, meta.top_p, meta.max_top_k)
        else:
            # Top-k for every row (through topk), then top-p's sort for the few rows that use it:
            # the same result, since top-k masks with the same tie rule in both paths.
            apply_top_k_top_p(scaled, meta.top_k, None, meta.max_top_k)
            rows = meta.top_p_rows
            subset = scaled.index_select(0, rows)
            apply_top_k_top_p(subset, None, meta.top_p.index_select(0, rows))
            scaled.index_copy_(0, rows, subset)
        if meta.min_p is not None:
            apply_min_p(scaled, meta.min_p)
        probs = scaled.softmax(dim=-1)
        noise = exponential_noise((meta.num_reqs, meta.vocab_size), meta, scaled.device)
        return first_argmax(probs.div_(noise))
