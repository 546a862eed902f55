"""Processes: every process the engine starts, beneath the front ends that start them. Tensor-parallel
ranks (`tensor_parallel`), the engine-core process and its wire format (`engine_core`),
data-parallel replicas and their offline client (`data_parallel`), and the API-server processes of
`serve --api-server-count` (`api_servers`). Nothing here imports the HTTP server, the entry points
or the command line."""
