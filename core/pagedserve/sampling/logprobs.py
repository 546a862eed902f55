"""Logprobs of sampled tokens and of prompt tokens, on device, plus their conversion to `Logprob`s.

Logprobs are those of the model's raw distribution, `log_softmax(logits)` in float32, before
penalties, logit bias, temperature and top-k/top-p/min-p (vLLM's default "raw" mode, and what
HF's `log_softmax(model(...).logits)` gives), so they compare directly with a reference model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedserve.outputs import Logprob


@dataclass(frozen=True, slots=True)
class LogprobsTensors:
    """For each row: one chosen token (sampled, or the next prompt token) and the top-N tokens.

    Column 0 of `token_ids`/`logprobs` is the chosen token; columns 1..N are the N most likely tokens
    by decreasing logprob (ties in torch.topk's order). A request that asked for fewer than N reads
    only its first columns."""

    token_ids: torch.Tensor  # [num_rows, 1 + num_logprobs] int64
    logprobs: torch.Tensor  # [num_rows, 1 + num_logprobs] float32
    ranks: torch.Tensor  # [num_rows] int64; 1-based rank of column 0's token (1 = most likely)

    def to_cpu(self) -> LogprobsTensors:
        """A copy on the host (one transfer per tensor). Does not mutate."""
        return LogprobsTensors(self.token_ids.cpu(), self.logprobs.cpu(), self.ranks.cpu())


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Pick each row's chosen token and its top-`num_logprobs` out of full log-probabilities.

    logprobs: [num_rows, vocab_size] float32 (already log-softmaxed); token_ids: [num_rows] int.
    Does not mutate its arguments."""
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be >= 0, got {num_logprobs}")
    chosen_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    # Rank = 1 + number of tokens strictly more likely; ties share the better rank.
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(num_logprobs, dim=1)
    return LogprobsTensors(
        token_ids=torch.cat([chosen_ids, top_ids], dim=1),
        logprobs=torch.cat([chosen, top_values], dim=1),
        ranks=ranks,
    )


def compute_prompt_logprobs(
    logits: torch.Tensor,  # [num_positions, vocab_size]; row j is the model's output at prompt position j
    next_token_ids: torch.Tensor,  # [num_positions] the prompt token that follows each position
    num_logprobs: int,
) -> LogprobsTensors:
    """Logprobs of prompt tokens 1..P-1 (each scored by the logits of the position before it).

    With chunked prefill the caller passes one chunk's positions at a time and concatenates the
    per-token dicts; the prompt's first token has no logprob (None in `RequestOutput.prompt_logprobs`).
    Does not mutate its arguments."""
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"logits must be [num_positions, vocab] and next_token_ids [num_positions]; got "
            f"{tuple(logits.shape)} and {tuple(next_token_ids.shape)}"
        )
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), next_token_ids, num_logprobs)


def logprobs_to_dicts(
    tensors: LogprobsTensors,
    num_logprobs: Sequence[int],  # row -> how many top logprobs that row's request asked for
    decode: Callable[[int], str] | None = None,  # token id -> its text; None leaves decoded_token None
) -> list[dict[int, Logprob]]:
    """Convert host-side logprob tensors to one `{token_id: Logprob}` per row: the chosen token
    first, then the request's top-N (so N or N + 1 entries). Does not mutate its arguments."""
    if len(num_logprobs) != tensors.token_ids.shape[0]:
        rows = tensors.token_ids.shape[0]
        raise ValueError(f"num_logprobs has {len(num_logprobs)} entries for {rows} rows")
    ids = tensors.token_ids.tolist()
    values = tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    out: list[dict[int, Logprob]] = []
    for row, wanted in enumerate(num_logprobs):
        if wanted > len(ids[row]) - 1:
            raise ValueError(f"row {row} wants {wanted} logprobs but only {len(ids[row]) - 1} were computed")
        entry: dict[int, Logprob] = {}
        chosen = ids[row][0]
        entry[chosen] = Logprob(values[row][0], ranks[row], decode(chosen) if decode else None)
        for col in range(1, wanted + 1):
            token = ids[row][col]
            if token not in entry:
                entry[token] = Logprob(values[row][col], col, decode(token) if decode else None)
        out.append(entry)
    return out
