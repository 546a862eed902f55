"""Measuring one call on one case of the table, and the baselines ours is measured against:
torch SDPA (flash and cuDNN) and FlexAttention on contiguous copies of the paged batch, each
checked against our output before it is timed. A baseline that refuses a case is a result
("n/a" and why), not a crash.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from attention_batches import Batch
from timing import time_events, time_graph


@dataclass(slots=True)
class Measured:
    """One backend's result on one case: a time, or why there is none."""

    us: float | None = None
    timing: str = ""  # "graph" (CUDA-graph replay), "events" (launches timed by events) or "wall" (CPU)
    error: str | None = None
    max_diff: float | None = None  # max |out - ours| over the batch
    note: str = ""

    kv_expanded: bool = False  # GQA refused: K/V were expanded to the query heads (more bytes read)

    def cell(self, tolerance: float) -> str:
        if self.us is None:
            return f"n/a ({self.error or '?'})"
        mark = "*" if self.timing == "events" else ""
        mark += "x" if self.kv_expanded else ""
        if self.max_diff is not None and not self.max_diff <= tolerance:
            mark += "!"
        return f"{self.us:.1f}{mark}"


class Timer:
    """Times a callable: CUDA-graph replay on a GPU (falling back to CUDA events over many plain
    launches when capture fails), wall clock on CPU (`--smoke`, plumbing only)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object], m: Measured) -> None:
        """Fills `m.us` and `m.timing`; mutates only `m`."""
        if self.device.type != "cuda":
            fn()
            start = time.perf_counter()
            fn()
            m.us, m.timing = (time.perf_counter() - start) * 1e6, "wall"
            return
        try:
            m.us, m.timing = time_graph(fn), "graph"
        except Exception as e:  # some compiled or library paths refuse capture: time plain launches
            torch.cuda.synchronize()
            m.note = f"graph capture failed ({type(e).__name__}); events over launches"
            m.us, m.timing = time_events(fn), "events"


@dataclass(frozen=True, slots=True)
class Built:
    """A baseline ready to time: its call, the map of its output to [tokens, q_heads, head_size],
    and anything the table should say about how it ran."""

    fn: Callable[[], torch.Tensor]
    to_rows: Callable[[torch.Tensor], torch.Tensor]
    note: str = ""
    kv_expanded: bool = False


def measure(build: Callable[[], Built], ours: torch.Tensor, timer: Timer) -> Measured:
    """Build a baseline, check its output against ours, then time it. Any exception becomes "n/a"
    with its type (a backend refusing a shape is a result to report, not a crash)."""
    m = Measured()
    try:
        built = build()
        m.note, m.kv_expanded = built.note, built.kv_expanded
        m.max_diff = float((built.to_rows(built.fn()).float() - ours.float()).abs().max())
        timer(built.fn, m)
    except Exception as e:
        m.us, m.error = None, type(e).__name__
        first_line = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        m.note = f"{type(e).__name__}: {first_line}"
    return m


@dataclass(frozen=True, slots=True)
class Group:
    """Requests sharing (query_len, seq_len), as contiguous batched copies for SDPA and Flex."""

    query_len: int
    seq_len: int
    q: torch.Tensor  # [n, q_heads, query_len, head_size]
    k: torch.Tensor  # [n, kv_heads, seq_len, head_size]
    v: torch.Tensor  # [n, kv_heads, seq_len, head_size]
    rows: torch.Tensor  # [n * query_len] int64: the flattened batch's row of each (request, position)


def contiguous_request_kv(batch: Batch, req: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request `req`'s K and V as [kv_heads, seq_len, head_size] copies out of the paged cache."""
    s = batch.seq_lens[req]
    blocks = batch.metadata.block_table[req].long()
    _, _, _, hkv, d = batch.kv_cache.shape
    k = batch.kv_cache[0][blocks].reshape(-1, hkv, d)[:s].transpose(0, 1).contiguous()
    v = batch.kv_cache[1][blocks].reshape(-1, hkv, d)[:s].transpose(0, 1).contiguous()
    return k, v


def make_groups(batch: Batch) -> list[Group]:
    """Contiguous copies of `batch`, one batched group per distinct (query_len, seq_len). Does not
    mutate `batch`."""
    starts = batch.metadata.query_start_loc_cpu.tolist()
    by_shape: dict[tuple[int, int], list[int]] = {}
    for i, key in enumerate(zip(batch.query_lens, batch.seq_lens, strict=True)):
        by_shape.setdefault(key, []).append(i)
    _, _, _, hkv, d = batch.kv_cache.shape
    groups = []
    for (ql, sl), reqs in by_shape.items():
        rows = torch.cat([torch.arange(starts[i], starts[i] + ql) for i in reqs]).to(batch.query.device)
        q = batch.query[rows].reshape(len(reqs), ql, *batch.query.shape[1:]).transpose(1, 2).contiguous()
        # Only the blocks these requests own: [n, blocks, block, kv_heads, head] -> [n, kv_heads, sl, head]
        blocks = batch.metadata.block_table[torch.tensor(reqs, device=batch.query.device)].long()
        blocks = blocks[:, : -(-sl // batch.kv_cache.shape[2])]
        k = batch.kv_cache[0][blocks].reshape(len(reqs), -1, hkv, d)[:, :sl].transpose(1, 2).contiguous()
        v = batch.kv_cache[1][blocks].reshape(len(reqs), -1, hkv, d)[:, :sl].transpose(1, 2).contiguous()
        groups.append(Group(ql, sl, q, k, v, rows))
    return groups


def scatter_groups(batch: Batch, groups: list[Group], outs: list[torch.Tensor]) -> torch.Tensor:
    """Per-group outputs [n, q_heads, query_len, head_size] back into the batch's row order."""
    full = torch.empty_like(batch.query)
    for g, o in zip(groups, outs, strict=True):
        full[g.rows] = o.transpose(1, 2).reshape(-1, *batch.query.shape[1:])
    return full


def lower_right_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True where query row j may see key i (i <= seq_len - query_len + j)."""
    return torch.ones(query_len, seq_len, dtype=torch.bool, device=device).tril(seq_len - query_len)


def sdpa_builder(batch: Batch, groups: list[Group], backend: str) -> Callable[[], Built]:
    """SDPA `backend` ("flash" or "cudnn") on the contiguous groups, one call per group: no mask
    for decodes, is_causal for full prefills. A query shorter than its sequence needs bottom-right
    causality: flash gets it from its own op (whose `is_causal` is bottom-right aligned), cuDNN
    from an explicit bool mask. K/V keep their 8 heads (`enable_gqa`); only if the backend refuses
    that are they expanded to the query heads before timing, which the table notes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdp = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION
    scale = batch.query.shape[-1] ** -0.5
    masks = {
        (g.query_len, g.seq_len): lower_right_mask(g.query_len, g.seq_len, batch.query.device)
        for g in groups
        if 1 < g.query_len < g.seq_len and backend == "cudnn"
    }

    def one(g: Group, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if 1 < g.query_len < g.seq_len and backend == "flash":
            out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(
                g.q, k, v, 0.0, is_causal=True, scale=scale
            )[0]
            return out
        mask = masks.get((g.query_len, g.seq_len))
        causal = g.query_len == g.seq_len and g.query_len > 1
        with sdpa_kernel([sdp]):
            return F.scaled_dot_product_attention(
                g.q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )

    def build() -> Built:
        outs: list[torch.Tensor] = []
        kvs = [(g.k, g.v) for g in groups]

        def fn() -> torch.Tensor:
            outs[:] = [one(g, k, v) for g, (k, v) in zip(groups, kvs, strict=True)]
            return outs[0]

        note, expanded = "", False
        try:
            fn()
        except RuntimeError as e:
            group = batch.query.shape[1] // batch.kv_cache.shape[3]
            if group == 1:
                raise
            kvs[:] = [(g.k.repeat_interleave(group, 1), g.v.repeat_interleave(group, 1)) for g in groups]
            fn()  # if expanded K/V fail too, that error is the result
            note = f"GQA refused ({type(e).__name__}); K/V expanded to {batch.query.shape[1]} heads"
            expanded = True
        return Built(fn, lambda _: scatter_groups(batch, groups, outs), note, expanded)

    return build


_FLEX: dict[str, Callable[..., torch.Tensor]] = {}


def flex_fn(compiled: bool) -> Callable[..., torch.Tensor]:
    """FlexAttention, compiled once per process (shapes recompile inside dynamo's cache)."""
    key = "compiled" if compiled else "eager"
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if compiled:
            # One static-shape compile per case; dynamo's default limit (8) would silently fall
            # back to eager (dense scores) after the eighth shape.
            # (Older torch names these cache_size_limit; set whichever this version has.)
            for name, value in (
                ("recompile_limit", 256),
                ("cache_size_limit", 256),
                ("accumulated_recompile_limit", 4096),
                ("accumulated_cache_size_limit", 4096),
            ):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, value)
            _FLEX[key] = torch.compile(flex_attention, dynamic=False)
        else:
            _FLEX[key] = flex_attention
    return _FLEX[key]


def flex_builder(batch: Batch, groups: list[Group], compiled: bool) -> Callable[[], Built]:
    """FlexAttention on contiguous copies. A uniform batch runs batched with a bottom-right causal
    block mask (none for decodes); a ragged batch runs as one concatenated sequence with a
    document mask: a query sees keys of its own request at positions <= its own."""
    from torch.nn.attention.flex_attention import create_block_mask

    flex = flex_fn(compiled)
    dev = batch.query.device
    scale = batch.query.shape[-1] ** -0.5

    def build() -> Built:
        if len(groups) == 1:
            g = groups[0]
            block_mask = None
            if g.query_len > 1:
                offset = g.seq_len - g.query_len

                def offset_causal(
                    b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
                ) -> torch.Tensor:
                    return ki <= qi + offset

                block_mask = create_block_mask(offset_causal, None, None, g.query_len, g.seq_len, device=dev)

            def fn() -> torch.Tensor:
                out: torch.Tensor = flex(g.q, g.k, g.v, block_mask=block_mask, scale=scale, enable_gqa=True)
                return out

            return Built(fn, lambda o: scatter_groups(batch, groups, [o]))
        q = batch.query[: batch.metadata.num_actual_tokens].transpose(0, 1).unsqueeze(0).contiguous()
        kvs = [contiguous_request_kv(batch, i) for i in range(len(batch.seq_lens))]
        k = torch.cat([kv[0] for kv in kvs], dim=1).unsqueeze(0)
        v = torch.cat([kv[1] for kv in kvs], dim=1).unsqueeze(0)
        del kvs
        # Mask lookups are padded to Flex's 128-row blocks with document ids no real row has, so
        # a padded index never reads past a table or matches a request.
        n = len(batch.seq_lens)
        pad = 128

        def doc_table(
            lens: list[int], first_pos: list[int], pad_doc: int
        ) -> tuple[torch.Tensor, torch.Tensor]:
            docs = torch.repeat_interleave(torch.arange(n), torch.tensor(lens))
            pos = torch.cat([torch.arange(p, p + ln) for p, ln in zip(first_pos, lens, strict=True)])
            extra = -len(docs) % pad
            docs = torch.cat([docs, torch.full((extra,), pad_doc)])
            pos = torch.cat([pos, torch.zeros(extra, dtype=torch.long)])
            return docs.to(dev), pos.to(dev)

        contexts = [s - ql for ql, s in zip(batch.query_lens, batch.seq_lens, strict=True)]
        q_doc, q_pos = doc_table(batch.query_lens, contexts, n)
        k_doc, k_pos = doc_table(batch.seq_lens, [0] * n, n + 1)

        def document_causal(
            b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
        ) -> torch.Tensor:
            return (q_doc[qi] == k_doc[ki]) & (k_pos[ki] <= q_pos[qi])

        block_mask = create_block_mask(document_causal, None, None, q.shape[2], k.shape[2], device=dev)

        def ragged() -> torch.Tensor:
            out: torch.Tensor = flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)
            return out

        return Built(ragged, lambda o: o[0].transpose(0, 1), "concatenated, document mask")

    return build
