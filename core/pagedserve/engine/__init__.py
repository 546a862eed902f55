"""The engine: the core loop (scheduler + model runner) and the front end (tokens in, text out)."""
