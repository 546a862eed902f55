"""Getting one device's model runner ready: load its model, size and allocate its KV cache, warm up
its kernels, compile its forward, capture its graphs, then build the runner from all of them."""
