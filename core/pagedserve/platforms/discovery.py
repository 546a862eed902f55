"""Finding plugins and deciding which to accept.

Every plugin, whether found through an entry point or handed over in code, goes through one path
(`PluginLoader.load`): import it, check its declared API version, register it with pluggy (which
checks hook signatures), reject unknown hooks (`check_pending`), then ask it for its platforms. A
plugin failing any step is reported by name and skipped, or raises `PluginError` in strict mode
(env PAGEDSERVE_STRICT_PLUGINS=1), so one broken third-party package never hides the others.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import cast

import pluggy

from pagedserve.platforms import hookspecs
from pagedserve.platforms.api import PLUGIN_API_VERSION, PlatformInfo
from pagedserve.platforms.errors import PluginError, PluginLoadError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "pagedserve.platforms"
STRICT_ENV = "PAGEDSERVE_STRICT_PLUGINS"
API_ATTRIBUTE = "PAGEDSERVE_PLUGIN_API"
UNKNOWN_VERSION = "unknown"

_API_RE = re.compile(r"(\d+)\.(\d+)")


def strict_from_env() -> bool:
    """Whether PAGEDSERVE_STRICT_PLUGINS asks for broken plugins to raise instead of being skipped."""
    value = os.environ.get(STRICT_ENV, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise PluginError(f"{STRICT_ENV}={value!r} is not understood: use 1 (strict) or 0 (report and skip)")


def api_version_problem(declared: object) -> str | None:
    """Why a plugin declaring `declared` as its API version is refused, or None if it is compatible:
    same major number as `PLUGIN_API_VERSION` and a minor number not newer than ours."""
    major, minor = (int(p) for p in PLUGIN_API_VERSION.split("."))
    supported = f"this pagedserve supports plugin API {major}.0 to {major}.{minor}"
    if declared is None:
        return (
            f"declares no plugin API version; {supported}: add `{API_ATTRIBUTE} = "
            f'"{PLUGIN_API_VERSION}"` to the plugin module'
        )
    m = _API_RE.fullmatch(declared) if isinstance(declared, str) else None
    if m is None:
        return f'declares {API_ATTRIBUTE} = {declared!r}, which is not a "MAJOR.MINOR" string; {supported}'
    if int(m[1]) != major or int(m[2]) > minor:
        return f"is written for plugin API {declared}; {supported}: use a plugin release built for it"
    return None


@dataclass(frozen=True, slots=True)
class PluginSource:
    """A plugin before it is loaded: its name, where it comes from and how to get its object."""

    name: str
    distribution: str | None  # None when handed over in code
    version: str  # the distribution's version; UNKNOWN_VERSION when handed over in code
    load: Callable[[], object]  # imports the module (entry points) or returns the object


def entry_point_sources(group: str = ENTRY_POINT_GROUP) -> list[PluginSource]:
    """Every entry point of `group`, sorted by name so duplicate platform names resolve the same way
    on every machine. Loads nothing."""
    sources = []
    for ep in sorted(entry_points(group=group), key=lambda e: (e.name, e.value)):
        dist = ep.dist
        sources.append(
            PluginSource(
                name=ep.name,
                distribution=dist.name if dist is not None else None,
                version=dist.version if dist is not None else UNKNOWN_VERSION,
                load=ep.load,
            )
        )
    return sources


def _returning(obj: object) -> Callable[[], object]:
    return lambda: obj


def object_sources(plugins: Iterable[tuple[str, object]]) -> list[PluginSource]:
    """Plugin objects (modules, classes, instances) handed over in code, in the given order."""
    return [
        PluginSource(name=name, distribution=None, version=UNKNOWN_VERSION, load=_returning(obj))
        for name, obj in plugins
    ]


class PluginProblems:
    """Where plugin problems go: a list (and a log warning) normally, a `PluginError` in strict mode.
    Shared by discovery and by later hook calls, so `load_errors` shows both."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self.errors: list[PluginLoadError] = []  # in the order they happened
        self._distributions: dict[str, str | None] = {}  # plugin name -> distribution

    def know(self, source: PluginSource) -> None:
        """Remember which distribution `source` came from, to name it in reports of later hook
        calls. The first plugin of a name keeps it. Mutates."""
        self._distributions.setdefault(source.name, source.distribution)

    def report(self, plugin_name: str, error: str) -> None:
        """Record a problem of the accepted plugin `plugin_name` (mutates), or raise `PluginError`
        in strict mode."""
        self._add(PluginLoadError(plugin_name, self._distributions.get(plugin_name), error))

    def report_source(self, source: PluginSource, error: str) -> None:
        """Like `report`, for a plugin being loaded (its own distribution, even if its name is taken)."""
        self._add(PluginLoadError(source.name, source.distribution, error))

    def _add(self, problem: PluginLoadError) -> None:
        if self.strict:
            raise PluginError(f"{problem} (strict mode: {STRICT_ENV}=1)")
        logger.warning("skipping %s", problem)
        self.errors.append(problem)


def call_each(
    pm: pluggy.PluginManager, problems: PluginProblems, hook_name: str, **kwargs: object
) -> Iterator[tuple[str, object]]:
    """Call the implementations of `hook_name` one at a time, in pluggy's call order, yielding
    `(plugin_name, result)`. An implementation that raises is reported against its plugin and
    skipped: pluggy's own call would abort every plugin on the first exception. Stop iterating to
    get first-result semantics."""
    hook = getattr(pm.hook, hook_name)
    for impl in reversed(hook.get_hookimpls()):  # pluggy calls the last registered first
        try:
            result = impl.function(*(kwargs[arg] for arg in impl.argnames))
        except Exception as e:
            problems.report(impl.plugin_name, f"hook {hook_name}({_fmt_kwargs(kwargs)}) raised {_fmt_exc(e)}")
            continue
        yield impl.plugin_name, result


@dataclass(frozen=True, slots=True)
class AcceptedPlugin:
    """A plugin that passed every check, with the platforms it provides."""

    name: str
    distribution: str | None
    version: str
    api_version: str  # what it declared, e.g. "1.0"
    platforms: tuple[PlatformInfo, ...]  # those not refused as duplicates


class PluginLoader:
    """Runs the checks of the module docstring over plugin sources. One loader builds one manager."""

    def __init__(self, problems: PluginProblems) -> None:
        self.problems = problems
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._platform_owner: dict[str, str] = {}  # platform name -> plugin name

    def load(self, sources: Iterable[PluginSource]) -> list[AcceptedPlugin]:
        """Load, check and register each source; return the accepted ones in order. A source whose
        plugin name an earlier source already has (two distributions declaring one entry-point
        name) is refused, naming both distributions, before it is imported. Mutates the manager
        and `problems`."""
        accepted = []
        first_of_name: dict[str, PluginSource] = {}  # plugin name -> the source that has it
        for source in sources:
            first = first_of_name.setdefault(source.name, source)
            if first is not source:
                self.problems.report_source(source, _duplicate_name_problem(source, first))
                continue
            self.problems.know(source)
            plugin = self._load_one(source)
            if plugin is not None:
                accepted.append(plugin)
        return accepted

    def _load_one(self, source: PluginSource) -> AcceptedPlugin | None:
        try:
            obj = source.load()
        except Exception as e:
            self.problems.report_source(source, f"failed to import: {_fmt_exc(e)}")
            return None
        declared = getattr(obj, API_ATTRIBUTE, None)
        refusal = api_version_problem(declared)
        if refusal is not None:
            self.problems.report_source(source, refusal)
            return None
        assert isinstance(declared, str)  # api_version_problem accepts only strings
        if not self._register(source, obj):
            return None
        infos = self._ask_platforms(source, obj)
        if infos is None:
            return None
        return AcceptedPlugin(source.name, source.distribution, source.version, declared, infos)

    def _register(self, source: PluginSource, obj: object) -> bool:
        """Register with pluggy's checks on; undo and report on any failure."""
        try:
            self.pm.register(obj, name=source.name)
            self.pm.check_pending()  # earlier plugins passed it, so a failure is this plugin's
            wrappers = [
                caller.name
                for caller in self.pm.get_hookcallers(obj) or []
                for impl in caller.get_hookimpls()
                if impl.plugin is obj and (impl.wrapper or impl.hookwrapper)
            ]
            if wrappers:
                raise pluggy.PluginValidationError(
                    obj, f"hook wrappers are not part of the plugin API; unwrap {', '.join(wrappers)}"
                )
        except pluggy.PluginValidationError as e:
            if self.pm.is_registered(obj) and self.pm.get_name(obj) == source.name:
                self.pm.unregister(obj)
            self.problems.report_source(source, f"has an invalid hook: {e}")
            return False
        except ValueError as e:  # pluggy: the name or the object is already registered
            self.problems.report_source(source, f"cannot be registered: {e}")
            return False
        return True

    def _ask_platforms(self, source: PluginSource, obj: object) -> tuple[PlatformInfo, ...] | None:
        """This plugin's answer to `pagedserve_platforms`, minus names already taken. A plugin whose
        hook raises or returns anything but valid PlatformInfos is unregistered and reported."""
        impls = [i for i in self.pm.hook.pagedserve_platforms.get_hookimpls() if i.plugin is obj]
        found: list[PlatformInfo] = []
        for impl in impls:
            problem: str | None
            try:
                result = impl.function()
            except Exception as e:
                problem = f"hook pagedserve_platforms() raised {_fmt_exc(e)}"
            else:
                problem = _platform_list_problem(result)
            if problem is not None:
                self.pm.unregister(obj)
                self.problems.report_source(source, problem)
                return None
            found.extend(cast("list[PlatformInfo]", result))  # checked just above
        infos: list[PlatformInfo] = []
        for info in found:
            owner = self._platform_owner.get(info.name)
            if owner is not None:
                self.problems.report_source(
                    source,
                    f"platform {info.name!r} is already provided by plugin {owner!r}; this one is ignored",
                )
                continue
            self._platform_owner[info.name] = source.name
            infos.append(info)
        return tuple(infos)


def _describe_distribution(source: PluginSource) -> str:
    if source.distribution is None:
        return f"an object handed over in code ({source.name!r})"
    return f"distribution {source.distribution} {source.version}"


def _duplicate_name_problem(source: PluginSource, first: PluginSource) -> str:
    """Why `source` is refused: `first` already has its plugin name."""
    return (
        f"declares the plugin name {source.name!r} (entry point group {ENTRY_POINT_GROUP!r}), which "
        f"{_describe_distribution(first)} already declares; this one, from {_describe_distribution(source)}, "
        "is refused: plugin names must be unique across installed packages (uninstall one, or rename "
        "its entry point)"
    )


def _platform_list_problem(result: object) -> str | None:
    """What is wrong with a `pagedserve_platforms` answer, or None."""
    if not isinstance(result, list | tuple) or not all(isinstance(i, PlatformInfo) for i in result):
        return f"hook pagedserve_platforms() must return a list of PlatformInfo, got {result!r}"
    for info in result:
        if not isinstance(info.name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", info.name):
            return f"platform name {info.name!r} must be a non-empty word (letters, digits, _ . -)"
        if isinstance(info.priority, bool) or not isinstance(info.priority, int):
            return f"platform {info.name!r} has priority {info.priority!r}; it must be an int"
        if not callable(info.is_available):
            return f"platform {info.name!r}: is_available must be callable, got {info.is_available!r}"
    return None


def _fmt_exc(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _fmt_kwargs(kwargs: dict[str, object]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
