"""The objects an engine builds at start-up, kept out of the garbage collector's full collections.

Why. Start-up leaves hundreds of thousands of long-lived objects behind: the model's modules, the
compiled forward's graphs and guards, the captured CUDA graphs, the tokenizer. Python's cyclic
collector walks every tracked object in each full (oldest-generation) collection, and it starts
one whenever enough new objects have survived since the last, at a moment no one chooses: in the
middle of a decode loop it stops the host for as long as the walk takes (a 135M-parameter engine
with the compiled forward: about 0.35 s on a 2-core CPU; an 8B engine with both compilations of
the forward holds more). Moving the start-up objects into the collector's permanent generation
(`gc.freeze`) takes them out of every later walk; reference counting still frees them as before.

The cost: garbage cycles among frozen objects are not found until they are unfrozen. Each engine's
start-up therefore unfreezes everything first and collects, so the start-up objects of an engine
dropped earlier in the process are released when the next one starts; then it freezes what is
alive. At interpreter exit everything is unfrozen again, so that the collection the interpreter
runs while shutting down finalizes those objects as it would have (extension modules that count
their objects, such as nanobind's, otherwise report them as leaked).
"""

from __future__ import annotations

import atexit
import gc
import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FrozenHeap:
    """What `freeze_startup_heap` did."""

    objects: int  # objects in the permanent generation after the freeze
    collect_s: float  # the full collection before it: what one collection during serving would cost


def freeze_startup_heap() -> FrozenHeap:
    """Unfreeze anything an earlier engine of this process froze, collect every generation, and
    freeze the survivors. Returns the counts. Mutates the interpreter's collector state."""
    gc.unfreeze()
    atexit.unregister(gc.unfreeze)  # registered once, however many engines start
    atexit.register(gc.unfreeze)
    start = time.perf_counter()
    gc.collect()
    collect_s = time.perf_counter() - start
    gc.freeze()
    frozen = FrozenHeap(objects=gc.get_freeze_count(), collect_s=collect_s)
    logger.info(
        "start-up heap frozen: %d objects out of later full collections (one took %.2f s)",
        frozen.objects,
        frozen.collect_s,
    )
    return frozen
