"""The engine core in a process of its own: the loop (`engine_proc`), the messages it exchanges with
a front end over ZeroMQ (`serialization`), and the server's core started ahead of its imports
(`early_core`)."""
