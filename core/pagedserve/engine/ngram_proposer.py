"""`NgramProposer`'s import path before speculative decoding got its own package (re-exports
`spec_decode/ngram.py`)."""

from pagedserve.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
