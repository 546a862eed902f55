"""Benchmarks: `pagedserve bench serve` (an HTTP load generator for OpenAI-compatible servers) and
`pagedserve bench throughput` (the offline engine on a workload file)."""
