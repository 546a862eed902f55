"""Data parallelism: `data_parallel_size` independent engine cores (each its own scheduler, KV cache
and model, on its own GPU or tensor-parallel group), one process (or, with
`distributed_executor_backend="ray"`, one Ray actor anywhere in a Ray cluster) each, behind one
front end that places every request on the replica with the least queued work."""
