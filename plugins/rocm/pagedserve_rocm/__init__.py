"""The ROCm platform: AMD Instinct GPUs through Triton's AMD backend, with AMD tables and XCD grid order."""
