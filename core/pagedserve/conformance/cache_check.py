"""Running one `CacheOpCase` on a platform's cache ops and comparing with the reference bit for bit.

Data movement is exact, so there is no tolerance: the destination after the call must equal, bit for
bit, what cpu_reference's cache ops produce from the same inputs. Destinations start out poisoned
(NaN) and live inside poisoned allocations, so a slot written that should not be, a slot left
unwritten, or a write past either end of a cache is reported. Inputs (keys, values, source caches)
must come back unchanged.

FP8 caches (`case.kv_cache_dtype`): `reshape_and_cache` quantizes with the suite's `FP8_KV_SCALES`
and must write exactly the reference's bits (`kv_cache_dtype.quantize`); copies and swaps move FP8
blocks as they are.

The cases mirror how the engine calls the ops: `reshape_and_cache` into shuffled slots that leave
blocks partly filled, with key/value possibly slices of a fused qkv tensor and with more rows than
slots (and, for ops that declare `skips_negative_slots`, padding tokens with slot -1 that must
write nothing); `copy_blocks` over several layers with a source block copied to two destinations (two
copy-on-write forks); `swap_blocks` within the device and between the device and the CPU.
"""

from __future__ import annotations

import torch

from pagedserve.conformance.cases import FP8_KV_SCALES, CacheOp, CacheOpCase
from pagedserve.conformance.guards import POISON, GuardedTensor, bits, count_changed
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import CaseResult, Status
from pagedserve.platforms.api import CacheOps

COMPONENT = "cache_ops"
EXTRA_ROWS = 2  # key/value rows past len(slot_mapping), which must not be written
PADDING_TOKENS = 2  # slot -1 tokens, for cache ops that declare `skips_negative_slots`


def _random(
    shape: tuple[int, ...], case: CacheOpCase, gen: torch.Generator, dtype: torch.dtype | None = None
) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype or case.dtype)


def _cache_random(shape: tuple[int, ...], case: CacheOpCase, gen: torch.Generator) -> torch.Tensor:
    """Cache contents for copies and swaps, in the cache's dtype (an FP8 cache holds scaled data)."""
    if case.kv_cache_dtype is None:
        return _random(shape, case, gen)
    return (torch.randn(shape, generator=gen) * 64).to(case.kv_cache_dtype)


def _cache_shape(case: CacheOpCase, num_blocks: int) -> tuple[int, ...]:
    return (2, num_blocks, case.block_size, case.num_kv_heads, case.head_size)


def _margin(case: CacheOpCase) -> int:
    return case.block_size * case.num_kv_heads * case.head_size


class _Checker:
    """Collects the problems of one call."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def unchanged(self, expected: torch.Tensor, actual: torch.Tensor, what: str) -> None:
        changed = count_changed(expected, actual)
        if changed:
            self.problems.append(f"{what}: {changed} elements differ from the reference")

    def guards(self, guarded: GuardedTensor, what: str) -> None:
        changed = guarded.margins_changed()
        if changed:
            self.problems.append(f"wrote {changed} elements outside {what} (out-of-bounds write)")


def _reshape_and_cache(
    ops: CacheOps,
    case: CacheOpCase,
    device: torch.device,
    oracle: Oracle,
    gen: torch.Generator,
    check: _Checker,
) -> None:
    n, b = case.num_items, case.block_size
    num_blocks = 2 * -(-n // b) + 3
    # Distinct random slots in the interior blocks: blocks end up partly filled, in any order.
    slots = (torch.randperm((num_blocks - 2) * b, generator=gen)[:n] + b).long()
    rows = n + EXTRA_ROWS
    if case.strided_inputs:
        fused_cpu = _random((rows, 3, case.num_kv_heads, case.head_size), case, gen)
        fused = fused_cpu.to(device)
        key, value = fused[:, 1], fused[:, 2]
        key_cpu, value_cpu = fused_cpu[:, 1], fused_cpu[:, 2]
    else:
        key_cpu = _random((rows, case.num_kv_heads, case.head_size), case, gen)
        value_cpu = _random((rows, case.num_kv_heads, case.head_size), case, gen)
        key, value = key_cpu.to(device), value_cpu.to(device)
    if ops.skips_negative_slots:
        # The last tokens are padding of a full CUDA graph (slot -1): the op promises to write
        # nothing for them, neither into the cache nor before or after it.
        slots[-PADDING_TOKENS:] = -1
    real = slots >= 0
    cache = GuardedTensor(_cache_shape(case, num_blocks), case.cache_dtype, device, _margin(case))
    expected = torch.full(_cache_shape(case, num_blocks), POISON, dtype=case.cache_dtype)
    ref_key, ref_value = key_cpu[:n][real].contiguous(), value_cpu[:n][real].contiguous()
    scales = {} if case.kv_cache_dtype is None else {"kv_scales": FP8_KV_SCALES}
    oracle.cache_ops.reshape_and_cache(ref_key, ref_value, expected, slots[real], **scales)
    ops.reshape_and_cache(key, value, cache.tensor, slots.to(device), **scales)
    check.guards(cache, "kv_cache")
    check.unchanged(expected, cache.tensor, "kv_cache")
    if count_changed(expected, cache.tensor):
        check.problems += token_slot_problems(expected, cache.tensor, slots[real])
    check.unchanged(key_cpu, key, "key (an input)")
    check.unchanged(value_cpu, value, "value (an input)")


MAX_TOKEN_LINES = 4  # per-token lines in one failure; the count of the rest follows


def token_slot_problems(expected: torch.Tensor, actual: torch.Tensor, slots: torch.Tensor) -> list[str]:
    """Where each wrongly written token went: "token 12 went to slot 45, expected slot 44". Token
    `i` is the `i`-th entry of `slots` (the real ones, padding removed); it is found in the actual
    cache by the bits of its key (and value), which are distinct random data. Does not mutate."""
    num_slots = expected.shape[1] * expected.shape[2]
    want = bits(expected).view(2, num_slots, -1)
    got = bits(actual).view(2, num_slots, -1)
    where_key: dict[bytes, list[int]] = {}
    for slot in range(num_slots):
        where_key.setdefault(got[0, slot].numpy().tobytes(), []).append(slot)
    lines: list[str] = []
    wrong = 0
    for token, t in enumerate(int(x) for x in slots):
        key_ok = bool(torch.equal(want[0, t], got[0, t]))
        value_ok = bool(torch.equal(want[1, t], got[1, t]))
        if key_ok and value_ok:
            continue
        wrong += 1
        if len(lines) >= MAX_TOKEN_LINES:
            continue
        found = [s for s in where_key.get(want[0, t].numpy().tobytes(), []) if s != t]
        if key_ok:
            lines.append(f"token {token}: its key is in slot {t} as expected but its value is not")
        elif found:
            lines.append(f"token {token} went to slot {found[0]}, expected slot {t}")
        else:
            lines.append(
                f"token {token} is in no slot (its key is written nowhere, or changed), expected slot {t}"
            )
    if wrong > len(lines):
        lines.append(f"... {wrong - len(lines)} more tokens are misplaced")
    written = {int(x) for x in slots}
    stray = [s for s in range(num_slots) if s not in written and not torch.equal(want[:, s], got[:, s])]
    if stray:
        lines.append(f"slots written that no token maps to: {stray[:8]}{'...' if len(stray) > 8 else ''}")
    return lines


def _copy_blocks(
    ops: CacheOps,
    case: CacheOpCase,
    device: torch.device,
    oracle: Oracle,
    gen: torch.Generator,
    check: _Checker,
) -> None:
    n = case.num_items
    num_blocks = 2 * n + 3
    chosen = torch.randperm(num_blocks, generator=gen)[: 2 * n].long()
    src, dst = chosen[:n].clone(), chosen[n:]
    if n >= 3:
        src[-1] = src[0]  # one block forked twice
    mapping = torch.stack((src, dst), dim=1)
    expected = [_cache_random(_cache_shape(case, num_blocks), case, gen) for _ in range(case.num_layers)]
    caches = []
    for layer in expected:
        guarded = GuardedTensor(tuple(layer.shape), case.cache_dtype, device, _margin(case))
        guarded.tensor.copy_(layer)
        caches.append(guarded)
    oracle.cache_ops.copy_blocks(expected, mapping)

    ops.copy_blocks([c.tensor for c in caches], mapping.to(device))
    for i, (guarded, want) in enumerate(zip(caches, expected, strict=True)):
        check.guards(guarded, f"kv_caches[{i}]")
        check.unchanged(want, guarded.tensor, f"kv_caches[{i}]")


def _swap_blocks(
    ops: CacheOps,
    case: CacheOpCase,
    device: torch.device,
    oracle: Oracle,
    gen: torch.Generator,
    check: _Checker,
) -> None:
    cpu = torch.device("cpu")
    src_device, dst_device = {
        CacheOp.SWAP_SAME_DEVICE: (device, device),
        CacheOp.SWAP_TO_HOST: (device, cpu),
        CacheOp.SWAP_FROM_HOST: (cpu, device),
    }[case.op]
    n = case.num_items
    num_src, num_dst = 2 * n + 1, 2 * n + 3  # unequal, so a swapped src/dst block count shows
    src_ids = torch.randperm(num_src, generator=gen)[:n].long()
    dst_ids = torch.randperm(num_dst, generator=gen)[:n].long()
    mapping = torch.stack((src_ids, dst_ids), dim=1)  # on the CPU, as the contract asks
    src_cpu = _cache_random(_cache_shape(case, num_src), case, gen)
    src = src_cpu.to(src_device)
    dst = GuardedTensor(_cache_shape(case, num_dst), case.cache_dtype, dst_device, _margin(case))
    expected = torch.full(_cache_shape(case, num_dst), POISON, dtype=case.cache_dtype)
    oracle.cache_ops.swap_blocks(src_cpu, expected, mapping)

    ops.swap_blocks(src, dst.tensor, mapping)
    check.guards(dst, "dst")
    check.unchanged(expected, dst.tensor, "dst")
    check.unchanged(src_cpu, src, "src (an input)")


_RUNNERS = {
    CacheOp.RESHAPE_AND_CACHE: _reshape_and_cache,
    CacheOp.COPY_BLOCKS: _copy_blocks,
    CacheOp.SWAP_SAME_DEVICE: _swap_blocks,
    CacheOp.SWAP_TO_HOST: _swap_blocks,
    CacheOp.SWAP_FROM_HOST: _swap_blocks,
}


def check_cache_case(ops: CacheOps, case: CacheOpCase, device: torch.device, oracle: Oracle) -> CaseResult:
    """Run `case` on `ops` (caches on `device`) and compare with the oracle. Never raises for a
    failure of `ops`: exceptions become problems of a FAILED result."""
    gen = torch.Generator().manual_seed(case.seed)
    check = _Checker()
    try:
        with torch.no_grad():
            _RUNNERS[case.op](ops, case, device, oracle, gen, check)
    except Exception as e:
        check.problems.append(f"{case.op.value} raised {type(e).__name__}: {e}")
    status = Status.FAILED if check.problems else Status.PASSED
    return CaseResult(COMPONENT, case, status, tuple(check.problems), None)
