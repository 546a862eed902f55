"""The CPU reference platform: plain torch, float64-capable, the oracle for every other platform."""
