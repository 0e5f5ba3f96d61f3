"""One registry for every plug-in family: engines, routing policies, trainers, agent loops, tool
parsers, rewards, advantage estimators, built-in models, config-section validators.

Each family's package owns one :class:`Registry` and keeps its own verbs (``register_engine``,
``get_policy``...) as thin wrappers, so the rules are the same everywhere:

* **Lazy entries.** A target is an object or an import path ``"pkg.module:attr"``; a path is
  imported on first :meth:`Registry.get` (so ``sim`` never pulls in vLLM, and a config can be
  validated against the names without importing any implementation). Built-ins are registered
  by path in their family's ``__init__``, not by the side effect of importing their module.
* **One duplicate rule.** Registering a name again raises :class:`AlreadyRegistered` unless the
  target is the identical one: the same object, or the same import path (a path and the object
  it names, or a module re-imported). So a ``@register_trainer("sync")`` decorator in the module
  that a lazy ``"...sync:SyncTrainer"`` entry points at is a no-op, and a plug-in cannot silently
  replace a built-in.
* **One unknown-name error.** :class:`UnknownName` lists the valid names; it is a ``KeyError`` and
  a ``ValueError`` both, which is what the six registries this replaces raised between them.
* **One type rule per family.** ``kind`` (a class or the import path of one) makes every target a
  subclass of it; ``callable_only`` makes every target callable. Objects are checked when
  registered, paths when first resolved (:class:`InvalidPlugin`, a ``TypeError``).
* **One import-path resolver.** :func:`resolve` is what every YAML ``_target_``, reward path and
  lazy entry goes through.

Traded away: no entry-point discovery (a plug-in registers itself, or is named by path), and a
registration made in one process is not seen in another (Ray workers import what they need).
This module is the bottom layer: it imports nothing of rollfleet but the errors.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Optional, TypeVar, Union, overload

from rollfleet.errors import AlreadyRegistered, InvalidPlugin, UnknownName

T = TypeVar("T")


def resolve(path: str) -> Any:
    """``"pkg.module:attr"`` (or verl's dotted ``"pkg.module.attr"``) -> the object.

    ``attr`` may be dotted (``"pkg.mod:Outer.Inner"``). A missing module raises
    ``ModuleNotFoundError``, a missing attribute ``ImportError``, a malformed path ``ValueError``.
    """
    if not isinstance(path, str):
        raise ValueError(f"an import path must be a string, got {path!r}")
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError(f"'{path}' is not an import path (expected 'pkg.module:Name' or 'pkg.module.Name')")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportError(f"cannot import '{attr}' from '{module}' (import path '{path}')", name=module) from None
    return obj


def import_path(obj: Any) -> Optional[str]:
    """The ``"module:qualname"`` path of a class or function (None for other objects)."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    return f"{module}:{qualname}"


def _paths(target: Any) -> set[str]:
    """Every spelling of ``target``'s import path (``mod:attr`` and ``mod.attr``)."""
    if isinstance(target, str):
        if ":" in target:
            return {target, target.replace(":", ".")}
        return {target}
    path = import_path(target)
    if not path or "<" in path:  # a lambda or a local: no importable path, only the object itself
        return set()
    return {path, path.replace(":", ".")}


@dataclass
class Entry(Generic[T]):
    """One registration: the target (object, or import path until first use) and its options."""

    target: Union[T, str]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def loaded(self) -> bool:
        return not isinstance(self.target, str)

    def describe(self) -> str:
        if isinstance(self.target, str):
            return f"'{self.target}'"
        return f"'{import_path(self.target) or repr(self.target)}'"


class Registry(Generic[T]):
    """Names -> plug-ins of one family (see the module docstring for the rules).

    ``family`` is the singular noun used in errors ("engine", "routing policy"). ``kind`` is a class
    (or the import path of one, resolved when first needed, so a registry need not import its base
    class) every target must subclass; ``callable_only`` asks for callables instead. ``hint`` ends
    the unknown-name message (e.g. "or use 'pkg.module:function'"). ``builtins`` registers
    ``{name: "pkg.module:attr"}`` by path, so nothing is imported to know the names.
    """

    def __init__(
        self,
        family: str,
        *,
        kind: Union[type, str, None] = None,
        callable_only: bool = False,
        hint: str = "",
        builtins: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.family = family
        self._kind = kind
        self._callable_only = callable_only
        self._hint = hint
        self._entries: dict[str, Entry[T]] = {}
        for name, path in (builtins or {}).items():
            self.register(name, path)

    # ------------------------------------------------------------------ registration
    @overload
    def register(
        self, name: str, target: None = None, *, options: Optional[Mapping[str, Any]] = None
    ) -> Callable[[T], T]: ...

    @overload
    def register(
        self, name: str, target: Union[T, str], *, options: Optional[Mapping[str, Any]] = None
    ) -> Union[T, str]: ...

    def register(self, name: str, target: Any = None, *, options: Optional[Mapping[str, Any]] = None) -> Any:
        """Register ``target`` (an object or ``"pkg.module:attr"``) as ``name``; without a target,
        a decorator. ``options`` travel with the entry (an agent loop's constructor kwargs).
        Returns the target, so the decorator form leaves the decorated object unchanged."""
        if target is None:

            def deco(obj: T) -> T:
                self.register(name, obj, options=options)
                return obj

            return deco
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.family} name must be a non-empty string, got {name!r}")
        if not isinstance(target, str):
            self._check(name, target, repr(target))
        new = Entry(target, dict(options or {}))
        old = self._entries.get(name)
        if old is not None:
            if not self._same(old, new):
                existing, given = old.describe(), new.describe()
                if existing == given:  # the same target: the options differ, so say them
                    existing, given = f"{existing} with options {old.options}", f"{given} with options {new.options}"
                raise AlreadyRegistered(self.family, name, existing, given)
            if old.loaded and not new.loaded:
                return target  # keep the loaded object; the path names the same thing
        self._entries[name] = new
        return target

    def unregister(self, name: str) -> None:
        """Forget ``name`` (for tests and plug-ins that clean up); unknown names raise."""
        self._entry(name)
        del self._entries[name]

    # ------------------------------------------------------------------ lookup
    def get(self, name: str) -> T:
        """The plug-in registered as ``name``, imported on first use; :class:`UnknownName` otherwise."""
        entry = self._entry(name)
        if not isinstance(entry.target, str):
            return entry.target
        path = entry.target
        obj = resolve(path)
        self._check(name, obj, f"'{path}'")
        current = self._entries.get(name)
        if current is not None and isinstance(current.target, str) and path in _paths(current.target):
            current.target = obj  # importing may have registered the object already; both are fine
        return obj

    def entry(self, name: str) -> Entry[T]:
        """The raw entry (target still a path if not yet used, and options); nothing is imported."""
        return self._entry(name)

    def options(self, name: str) -> dict[str, Any]:
        """A copy of the options ``name`` was registered with."""
        return dict(self._entry(name).options)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def check_name(self, name: str) -> str:
        """``name`` if registered (nothing is imported), :class:`UnknownName` otherwise; for config
        validators."""
        self._entry(name)
        return name

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._entries
        except TypeError:  # an unhashable value from a config
            return False

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.family!r}, names={self.names()})"

    # ------------------------------------------------------------------ internals
    def _entry(self, name: str) -> Entry[T]:
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name from a config
            raise UnknownName(self.family, str(name), self.names(), self._hint) from None

    def _same(self, old: Entry[T], new: Entry[T]) -> bool:
        if old.options != new.options:
            return False
        if old.target is new.target or _paths(old.target) & _paths(new.target):
            return True
        # An object and a path that re-exports it ("pkg.engines.sim:SimEngine" for a class defined
        # in pkg.engines.sim.engine): resolve the path (only here, when a name comes twice; the
        # object's module is loaded already). Two paths are compared as text, never imported.
        if isinstance(old.target, str) and not isinstance(new.target, str):
            path, obj = old.target, new.target
        elif isinstance(new.target, str) and not isinstance(old.target, str):
            path, obj = new.target, old.target
        else:
            return False
        try:
            return resolve(path) is obj
        except Exception:  # a path that does not import (yet: a decorator runs mid-import)
            return False

    def _check(self, name: str, obj: Any, shown: str) -> None:
        kind = self._kind
        if isinstance(kind, str):
            kind = self._kind = resolve(kind)
        if kind is not None and not (isinstance(obj, type) and issubclass(obj, kind)):
            raise InvalidPlugin(self.family, name, shown, f"a subclass of {kind.__qualname__}")
        if self._callable_only and not callable(obj):
            raise InvalidPlugin(self.family, name, shown, "callable")


__all__ = ["Registry", "Entry", "resolve", "import_path", "UnknownName", "AlreadyRegistered", "InvalidPlugin"]
