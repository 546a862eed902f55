"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the latest earlier occurrence
of a request's last few tokens. Free to compute, and it pays off on the repetitive text that
summarising, code editing and RAG produce. Drafts are verified exactly by the model runner."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.scheduler.request import Request
from pagedserve.spec_decode.proposer import Proposer, draft_room, is_decoding


class NgramProposer(Proposer):
    """Sets `spec_token_ids` on running requests. Mutates the requests it is given."""

    def __init__(self, num_speculative_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram ({min_ngram}) <= max_ngram ({max_ngram})")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, requests: Sequence[Request]) -> None:
        for request in requests:
            # Drafts for a request still prefilling would be scored against a prompt that is not
            # in the cache yet.
            if is_decoding(request):
                request.spec_token_ids = self.draft(request.all_token_ids)[: draft_room(request, self.k)]

    def draft(self, tokens: list[int]) -> list[int]:
        """The up to k tokens after the latest earlier match of the longest suffix n-gram.
        Does not mutate."""
        n_tokens = len(tokens)
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            suffix = tokens[n_tokens - n :]
            # Search right to left: the latest occurrence predicts the continuation best.
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + self.k]
                    if follow:
                        return follow
        return []
