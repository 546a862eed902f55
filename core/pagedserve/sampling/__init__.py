"""Sampling: request parameters, per-step batch metadata and the batched on-device sampler."""

from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.rows import SamplingRequest, build_sampling_metadata
from pagedserve.sampling.sampler import Sampler, SamplerOutput
from pagedserve.sampling.sampling_params import RequestOutputKind, SamplingParams, SamplingType

__all__ = [
    "RequestOutputKind",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "SamplingRequest",
    "SamplingType",
    "build_sampling_metadata",
]
