"""Data parallelism: `data_parallel_size` independent engine cores (each its own scheduler, KV cache
and model, on its own GPU or tensor-parallel group), one process each, behind one front end that
places every request on the replica with the least queued work."""
