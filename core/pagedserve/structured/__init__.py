"""Structured outputs: constrained decoding to a JSON schema, a regex, a choice, a grammar or a
structural tag."""
