"""The paged KV cache's CPU-side bookkeeping: block pool, free queue, prefix-cache hashing,
per-request block tables and the swap pool. No tensors here; see docs/kv_cache.md."""
