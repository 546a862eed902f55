"""The conformance suite of one platform: which items it runs and how one item runs.

    suite = ConformanceSuite.for_platform("triton", quick=True)
    for item in suite.items():
        result = suite.run_item(item)

Both entry points, `pagedserve conformance` and the pytest plugin, go through this class, so a
third-party plugin author runs exactly the items and checks that pagedserve's CI runs.

An item is one case for one component: every attention backend of the platform gets the attention
case matrix derived from its declared capabilities, the cascade cases when it declares cascade
attention (plugin API 1.16), and the engine smoke cases (a tiny model's
greedy tokens in each declared engine dtype, with the platform's cache ops); the platform's cache
ops get the cache-op cases for the platform's dtypes and its backends' block sizes; a platform with
a `LoRAKernel` gets the LoRA cases in its dtypes, one with an `MoEKernel` the MoE cases in its
dtypes and the kernel's declared weight dtypes and activations, and one with an `IntLinearKernel`
the integer-weight linear cases in its dtypes and the kernel's declared widths and group sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.conformance.attention_check import check_attention_case
from pagedserve.conformance.cache_check import COMPONENT as CACHE_COMPONENT
from pagedserve.conformance.cache_check import check_cache_case
from pagedserve.conformance.cascade_cases import CascadeCase, cascade_cases
from pagedserve.conformance.cascade_check import check_cascade_case
from pagedserve.conformance.cases import (
    AttentionCase,
    CacheOpCase,
    EngineCase,
    LoRACase,
    MoECase,
    attention_cases,
    cache_op_cases,
    engine_cases,
    lora_cases,
    moe_cases,
)
from pagedserve.conformance.engine_check import check_engine_case
from pagedserve.conformance.int_linear_cases import IntLinearCase, int_linear_cases
from pagedserve.conformance.int_linear_check import COMPONENT as INT_LINEAR_COMPONENT
from pagedserve.conformance.int_linear_check import check_int_linear_case
from pagedserve.conformance.lora_check import COMPONENT as LORA_COMPONENT
from pagedserve.conformance.lora_check import check_lora_case
from pagedserve.conformance.moe_check import COMPONENT as MOE_COMPONENT
from pagedserve.conformance.moe_check import check_moe_case
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import CaseResult
from pagedserve.platforms.api import AttentionBackend, CacheOps, IntLinearKernel, LoRAKernel, MoEKernel
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.registry import LoadedPlatform, PlatformRegistry, load_platforms


@dataclass(frozen=True, slots=True)
class SuiteItem:
    """One case for one component of the platform."""

    component: str  # attention backend name, "cache_ops", "lora", "moe" or "int_linear"
    case: AttentionCase | CacheOpCase | EngineCase | LoRACase | MoECase | IntLinearCase | CascadeCase

    @property
    def item_id(self) -> str:
        return f"{self.component}/{self.case.case_id}"


def resolve_device(platform: LoadedPlatform, *, allow_unavailable: bool) -> torch.device:
    """The device to put the platform's tensors on: its own when it is available; the CPU in CPU test
    mode (`allow_unavailable`), e.g. Triton kernels under TRITON_INTERPRET=1. Raises `PlatformError`
    naming the reason and the option otherwise."""
    if platform.availability.available:
        return platform.device
    if allow_unavailable:
        return torch.device("cpu")
    raise PlatformError(
        f"platform {platform.name!r} is not available here: {platform.availability.reason}. To run its "
        "backends on CPU tensors instead (CPU test mode, e.g. Triton with TRITON_INTERPRET=1 set), pass "
        "--allow-unavailable (pytest: --pagedserve-allow-unavailable)"
    )


class ConformanceSuite:
    """The items of one platform and the means to run them. Keeps one instance of each backend."""

    def __init__(
        self, platform: LoadedPlatform, *, device: torch.device, oracle: Oracle, quick: bool, seed: int = 0
    ) -> None:
        self.platform = platform
        self.device = device
        self.oracle = oracle
        self.quick = quick
        self.seed = seed
        self._backend_classes = {cls.name: cls for cls in platform.attention_backends()}  # name -> class
        if len(self._backend_classes) != len(platform.attention_backends()):
            raise PlatformError(f"platform {platform.name!r} has two attention backends with one name")
        self._backends: dict[str, AttentionBackend] = {}  # name -> instance, made on first use
        self._cache_ops: CacheOps | None = None
        self._lora: LoRAKernel | None = None
        self._lora_asked = False
        self._moe: MoEKernel | None = None
        self._moe_asked = False
        self._int_linear: IntLinearKernel | None = None
        self._int_linear_asked = False

    @classmethod
    def for_platform(
        cls,
        name: str,
        *,
        registry: PlatformRegistry | None = None,
        quick: bool = False,
        allow_unavailable: bool = False,
        seed: int = 0,
    ) -> ConformanceSuite:
        """The suite of platform `name` from `registry` (default: the installed plugins). Raises
        `PlatformError` for an unknown or unavailable platform (see `resolve_device`)."""
        reg = registry if registry is not None else load_platforms()
        platform = reg.get(name)
        device = resolve_device(platform, allow_unavailable=allow_unavailable)
        return cls(platform, device=device, oracle=Oracle.find(reg), quick=quick, seed=seed)

    @property
    def cpu_test_mode(self) -> bool:
        """Whether the platform's backends run on CPU tensors because the platform is unavailable."""
        return not self.platform.availability.available

    def describe_device(self) -> str:
        """The device for people: "cuda:0 (NVIDIA H100 80GB HBM3)", "cpu (CPU test mode)"."""
        if self.cpu_test_mode:
            return f"{self.device} (CPU test mode)"
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return str(self.device)

    def backend_names(self) -> list[str]:
        return list(self._backend_classes)

    def items(self) -> list[SuiteItem]:
        """Every item, attention backends first (in the platform's order), then cache ops, then the
        LoRA kernel's, the MoE kernel's and the integer-weight linear kernel's. Pure (asks the
        plugins for their LoRA, MoE and integer-weight linear kernels)."""
        found: list[SuiteItem] = []
        for name, backend in self._backend_classes.items():
            found += [
                SuiteItem(name, c)
                for c in attention_cases(backend.capabilities, quick=self.quick, seed=self.seed)
            ]
            found += [SuiteItem(name, c) for c in cascade_cases(backend.capabilities, seed=self.seed)]
            found += [
                SuiteItem(name, c)
                for c in engine_cases(
                    name, backend.capabilities, self.platform.info.supported_dtypes, seed=self.seed
                )
            ]
        block_sizes = {
            b for backend in self._backend_classes.values() for b in backend.capabilities.block_sizes
        }
        kv_cache_dtypes = {
            d for backend in self._backend_classes.values() for d in backend.capabilities.kv_cache_dtypes
        }
        found += [
            SuiteItem(CACHE_COMPONENT, c)
            for c in cache_op_cases(
                self.platform.info.supported_dtypes,
                block_sizes,
                quick=self.quick,
                seed=self.seed,
                kv_cache_dtypes=kv_cache_dtypes,
            )
        ]
        if self._lora_kernel() is not None:
            found += [
                SuiteItem(LORA_COMPONENT, c)
                for c in lora_cases(self.platform.info.supported_dtypes, quick=self.quick, seed=self.seed)
            ]
        moe = self._moe_kernel()
        if moe is not None:
            found += [
                SuiteItem(MOE_COMPONENT, c)
                for c in moe_cases(
                    self.platform.info.supported_dtypes,
                    moe.weight_dtypes,
                    moe.activations,
                    quick=self.quick,
                    seed=self.seed,
                )
            ]
        int_linear = self._int_linear_kernel()
        if int_linear is not None:
            found += [
                SuiteItem(INT_LINEAR_COMPONENT, c)
                for c in int_linear_cases(
                    int_linear, self.platform.info.supported_dtypes, quick=self.quick, seed=self.seed
                )
            ]
        return found

    def run_item(self, item: SuiteItem) -> CaseResult:
        """Run one item and judge it. A backend's exceptions become a FAILED result; errors of the
        suite itself (a broken oracle) propagate."""
        if isinstance(item.case, CacheOpCase):
            return check_cache_case(self._ops(), item.case, self.device, self.oracle)
        if isinstance(item.case, LoRACase):
            kernel = self._lora_kernel()
            assert kernel is not None, "LoRA items come only from a platform with a LoRA kernel"
            return check_lora_case(kernel, item.case, self.device, self.oracle.lora)
        if isinstance(item.case, MoECase):
            moe = self._moe_kernel()
            assert moe is not None, "MoE items come only from a platform with an MoE kernel"
            return check_moe_case(moe, item.case, self.device, self.oracle.moe)
        if isinstance(item.case, IntLinearCase):
            int_linear = self._int_linear_kernel()
            assert int_linear is not None, "int-linear items come only from a platform with such a kernel"
            return check_int_linear_case(int_linear, item.case, self.device, self.oracle.int_linear)
        if isinstance(item.case, CascadeCase):
            return check_cascade_case(self._backend(item.component), item.case, self.device, self.oracle)
        if isinstance(item.case, EngineCase):
            # A fresh backend, as an engine constructs one: the check asks `enable_new_kv_reads`.
            engine_backend = self._backend_classes[item.component]()
            return check_engine_case(engine_backend, self._ops(), item.case, self.device, self.oracle)
        return check_attention_case(self._backend(item.component), item.case, self.device, self.oracle)

    def run(self) -> list[CaseResult]:
        """Run every item, in order."""
        return [self.run_item(item) for item in self.items()]

    def _backend(self, name: str) -> AttentionBackend:
        backend = self._backends.get(name)
        if backend is None:
            backend = self._backend_classes[name]()
            self._backends[name] = backend
        return backend

    def _lora_kernel(self) -> LoRAKernel | None:
        if not self._lora_asked:
            self._lora = self.platform.lora_kernel()
            self._lora_asked = True
        return self._lora

    def _moe_kernel(self) -> MoEKernel | None:
        if not self._moe_asked:
            self._moe = self.platform.moe_kernel()
            self._moe_asked = True
        return self._moe

    def _int_linear_kernel(self) -> IntLinearKernel | None:
        if not self._int_linear_asked:
            self._int_linear = self.platform.int_linear_kernel()
            self._int_linear_asked = True
        return self._int_linear

    def _ops(self) -> CacheOps:
        if self._cache_ops is None:
            self._cache_ops = self.platform.cache_ops()
        return self._cache_ops
