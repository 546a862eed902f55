"""The worker: persistent input batch, staged buffers and the model runner."""
