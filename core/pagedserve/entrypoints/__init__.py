"""Entry points: the offline `LLM` API (the server and CLI sit beside it)."""
