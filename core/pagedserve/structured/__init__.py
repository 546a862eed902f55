"""Structured outputs: constrained decoding to a JSON schema, a regex, a choice or a grammar."""
