"""Putting a draft network beside the target: loaded on the target's platform and device (a draft
model through `models/loader.py` like any model, an EAGLE head from its checkpoint), its attention
backend chosen like the target's, its KV cache's share taken from the target's budget, and its
hooks into the runner (the target's hidden states; EAGLE-3's tapped layers) set.

The engine's set-up calls `load_draft` before the target's KV cache is sized (so that on a GPU the
draft's weights count as used memory), `split_kv_blocks` to share the pool, and
`attach_proposer` once the runner exists."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.config.cache import CacheConfig
from pagedserve.config.engine_config import EngineConfig, resolve_dtype
from pagedserve.config.speculative import SpeculativeConfig
from pagedserve.models.decoder import DecoderForCausalLM
from pagedserve.models.loader import load_config, load_model, resolve_model_source
from pagedserve.models.spec import PagedCausalLM
from pagedserve.models.weights import fill_dummy_weights
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.spec_decode.cost_model import SpeculationCostModel
from pagedserve.spec_decode.draft_cache import DraftKVCache
from pagedserve.spec_decode.eagle import aux_layer_ids, load_eagle_head
from pagedserve.spec_decode.hidden_tap import TappedTarget
from pagedserve.spec_decode.model_proposer import NetworkProposer
from pagedserve.spec_decode.network import DraftModelNetwork, DraftNetwork
from pagedserve.worker.startup.device_model import choose_backend
from pagedserve.worker.startup.kv_sizing import kv_block_bytes
from pagedserve.worker.target_hidden import TargetHidden

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedDraft:
    """A draft network on the target's device, with what was chosen for it."""

    network: DraftNetwork
    backend: AttentionBackend
    cache_ops: CacheOps
    tap: TappedTarget | None  # EAGLE-3: the target as the runner must run it; None otherwise


def load_draft(
    spec: SpeculativeConfig,
    config: EngineConfig,
    platform: LoadedPlatform,
    target: PagedCausalLM,
    device: torch.device,
) -> LoadedDraft:
    """Load `spec`'s draft network beside `target`. Raises ValueError naming the field for a
    draft this engine cannot run. Slow (reads weights)."""
    assert spec.model is not None  # resolve_speculative_config: every draft network names one
    dummy = config.model.load_format == "dummy"
    tap = None
    network: DraftNetwork
    if spec.method == "draft_model":
        dtype = config.model.dtype if spec.dtype == "auto" else resolve_dtype(spec.dtype, platform.info)
        loaded = load_model(
            spec.model,
            dtype=dtype,
            device=device,
            load_format="dummy" if dummy else "auto",
            seed=config.model.seed + 1,
        )
        network = DraftModelNetwork(loaded.model)
    else:
        if not isinstance(target, DecoderForCausalLM):
            raise ValueError(
                f"speculative_config.method {spec.method!r} needs a native target model (its embedding, "
                f"LM head and layers); {type(target).__name__} is not one"
            )
        source = resolve_model_source(spec.model)
        draft_config = load_config(source)
        head = load_eagle_head(source.directory, draft_config, spec.method, target, device, dummy=dummy)
        if dummy:
            fill_dummy_weights(head, config.model.seed + 1)
        network = head
        if spec.method == "eagle3":
            tap = TappedTarget(target, aux_layer_ids(draft_config, target.spec.num_layers))
    backend, _ = choose_backend(platform, network.spec, config.cache.block_size)
    logger.info(
        "speculative decoding: %s from %s, %d tokens per step, attention backend %s",
        spec.method,
        spec.model,
        spec.num_speculative_tokens,
        backend.name,
    )
    return LoadedDraft(network, backend, platform.cache_ops(), tap)


def lookahead_blocks(spec: SpeculativeConfig, cache: CacheConfig, max_num_seqs: int) -> int:
    """Draft blocks beyond the target's pool: every request may write k entries past its tokens."""
    return max_num_seqs * (-(-spec.num_speculative_tokens // cache.block_size) + 1)


def split_kv_blocks(
    total_target_blocks: int,
    draft: LoadedDraft,
    target_block_bytes: int,
    cache: CacheConfig,
    spec: SpeculativeConfig,
    max_num_seqs: int,
) -> int:
    """The target's blocks once the draft took its share of a pool measured as
    `total_target_blocks` target blocks: both caches hold the same tokens (plus the draft's
    lookahead), so the bytes split in proportion to one block of each. A pool given exactly
    (`num_kv_blocks`) is the target's alone. Pure."""
    if cache.num_kv_blocks is not None:
        return total_target_blocks
    draft_bytes = kv_block_bytes(draft.network.spec, cache.block_size)
    budget = (
        total_target_blocks * target_block_bytes - lookahead_blocks(spec, cache, max_num_seqs) * draft_bytes
    )
    return max(1, budget // (target_block_bytes + draft_bytes))


def build_proposer(
    draft: LoadedDraft,
    spec: SpeculativeConfig,
    device: torch.device,
    num_target_blocks: int,
    cache: CacheConfig,
    max_num_seqs: int,
) -> tuple[NetworkProposer, Callable[[TargetHidden], None] | None]:
    """The proposer over `draft`, with its KV cache allocated on `device`, and the forward
    listener the target's runner is built with (None for drafts that read no target state).
    Built before the runner: the runner takes the listener, and for EAGLE-3 the tapped target
    (`draft.tap`) as its model, at construction."""
    network = draft.network
    blocks = num_target_blocks + lookahead_blocks(spec, cache, max_num_seqs)
    kv = DraftKVCache(network.spec, blocks, cache.block_size, network.spec.dtype, device)
    proposer = NetworkProposer(
        network,
        kv,
        draft.backend,
        draft.cache_ops,
        spec.num_speculative_tokens,
        device,
        SpeculationCostModel(),
    )
    if not network.reads_target_hidden:
        return proposer, None
    tap = draft.tap
    if tap is None:
        return proposer, proposer.on_target_forward

    def listen(hidden: TargetHidden) -> None:
        proposer.on_target_forward(
            TargetHidden(hidden.req_ids, hidden.query_start, hidden.positions, tap.latest())
        )

    return proposer, listen
