"""The one registry of routing policies: name → :class:`~dlmix.routing.policies.base.Policy` subclass.

Three ways in, all ending in :meth:`PolicyRegistry.register`:

* a built-in policy is one file in ``dlmix/routing/policies/`` whose class is decorated with
  ``@register_policy("name")`` (every module of the package is imported with it, nothing else to edit);
* a front-end registers its own policies the same way when it is imported (the simulator's ``oracle``,
  :mod:`dlmix.sim.oracle`, exists only where ``dlmix.sim`` is loaded);
* a third-party package declares an entry point in the group ``dlmix.policies`` (:data:`ENTRY_POINT_GROUP`)::

      [project.entry-points."dlmix.policies"]
      shortest_queue = "my_pkg.policy:ShortestQueue"      # a Policy subclass (or a module that registers one)

  Entry points are looked up lazily: when a name is not registered yet, and when the registry is listed.

Lookups are by exact name. Names are unique: registering a different class under a taken name raises ValueError.
"""
from __future__ import annotations

import inspect
import warnings
from importlib.metadata import entry_points
from types import ModuleType
from typing import Callable, Dict, Iterator, Mapping, Type, TypeVar, Union

from dlmix.routing.policies.base import Policy

#: Entry-point group third-party policies are published under.
ENTRY_POINT_GROUP = "dlmix.policies"

P = TypeVar("P", bound=Type[Policy])


class PolicyRegistry(Mapping[str, Type[Policy]]):
    """Read-mostly mapping of policy names to classes, extended by :meth:`register` and the entry-point group.

    Iterating or a miss scans ``group``'s entry points (loading each new one once); a hit costs one dict lookup.
    An entry point that fails to load is remembered with its error and reported when its name is asked for.
    """

    def __init__(self, group: str = ENTRY_POINT_GROUP):
        self.group = group
        self._classes: Dict[str, Type[Policy]] = {}
        self._failed: Dict[str, str] = {}
        self._shadowed: set = set()
        self._checked = False  # warn_shadowed ran on a lookup for use

    def register(self, name: str, cls: Type[Policy]) -> Type[Policy]:
        """Add ``cls`` under ``name`` (and set ``cls.name``). Raises TypeError for a class that is not a Policy
        subclass, ValueError for an empty name or one taken by another class. Returns ``cls``."""
        if not (inspect.isclass(cls) and issubclass(cls, Policy)):
            raise TypeError(f"policy {name!r}: {cls!r} is not a subclass of dlmix.routing.policies.Policy")
        if not name or not isinstance(name, str):
            raise ValueError(f"policy name must be a non-empty string, got {name!r}")
        old = self._classes.get(name)
        if old is not None and old is not cls:
            raise ValueError(f"policy name {name!r} is taken by {old.__module__}.{old.__qualname__}; "
                             f"cannot register {cls.__module__}.{cls.__qualname__} under it")
        if "name" not in cls.__dict__ or cls.name != name:
            cls.name = name
        self._classes[name] = cls
        return cls

    def scan(self) -> None:
        """Load the entry points of :attr:`group` whose names are not registered yet."""
        self.warn_shadowed()
        for ep in entry_points(group=self.group):
            if ep.name in self._classes or ep.name in self._failed:
                continue
            try:
                obj = ep.load()
            except Exception as ex:  # a broken plugin must not break the others: reported on lookup
                self._failed[ep.name] = f"entry point {ep.value!r} failed to load: {type(ex).__name__}: {ex}"
                continue
            if isinstance(obj, ModuleType):
                if ep.name not in self._classes:  # the module registers its classes by decorator
                    self._failed[ep.name] = f"entry point {ep.value!r} registered no policy named {ep.name!r}"
                continue
            try:
                self.register(ep.name, obj)
            except (TypeError, ValueError) as ex:
                self._failed[ep.name] = f"entry point {ep.value!r}: {ex}"

    def _warn_shadowed_once(self) -> None:
        """:meth:`warn_shadowed` on the first lookup of a policy for use (not on every lookup: it reads the
        distributions' metadata)."""
        if not self._checked:
            self._checked = True
            self.warn_shadowed()

    def warn_shadowed(self) -> None:
        """Warn (RuntimeWarning, once per name) about entry points of :attr:`group` whose name a policy of another
        module already holds (e.g. a plugin named ``cost``): they are never used, which must not pass silently.
        Reads the entry-point metadata only; imports nothing."""
        for ep in entry_points(group=self.group):
            old = self._classes.get(ep.name)
            if old is None or ep.name in self._shadowed or ep.value.partition(":")[0] == old.__module__:
                continue
            self._shadowed.add(ep.name)
            warnings.warn(f"policy entry point {ep.name!r} = {ep.value!r} is ignored: the name {ep.name!r} is taken "
                          f"by {old.__module__}.{old.__qualname__}; publish it under another name", RuntimeWarning,
                          stacklevel=3)

    def __getitem__(self, name: str) -> Type[Policy]:
        cls = self._classes.get(name)
        if cls is None:
            self.scan()
            cls = self._classes.get(name)
            if cls is None:
                raise KeyError(name)
        return cls

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        self.scan()
        return iter(list(self._classes))

    def __len__(self) -> int:
        self.scan()
        return len(self._classes)

    def get_class(self, name: str) -> Type[Policy]:
        """The class registered as ``name``. Raises ValueError naming the known policies (and why a plugin of that
        name failed to load, if one did)."""
        self._warn_shadowed_once()
        try:
            return self[name]
        except KeyError:
            why = self._failed.get(name)
            if why:
                raise ValueError(f"policy {name!r} is unavailable: {why}") from None
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(self)}") from None

    def serving_class(self, name: str) -> Type[Policy]:
        """:meth:`get_class` for a live router. Raises ValueError for an unknown name (naming the policies a router can
        run: not the simulator-only ones, whose class has a ``bind_simulator`` method, e.g. the oracle) and for a
        simulator-only policy."""
        try:
            cls = self[name]
        except KeyError:
            if name in self._failed:
                return self.get_class(name)  # raises, with why its plugin failed to load
            serving = [n for n in self if not hasattr(self._classes[n], "bind_simulator")]
            raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(serving)}") from None
        self._warn_shadowed_once()
        if hasattr(cls, "bind_simulator"):
            raise ValueError(f"policy {name!r} runs only in the simulator (dlmix sim): it reads the simulated "
                             "cluster's true state, which a live router does not have")
        return cls

    def create(self, name: str, **params) -> Policy:
        """A new policy object: ``get_class(name)(**params)``. Raises ValueError for an unknown name and
        :class:`~dlmix.routing.policies.base.PolicyParamError` (a ValueError) for an unknown or invalid parameter,
        naming the valid ones."""
        return self.get_class(name)(**params)


#: The registry (a mapping ``name → class``).
POLICIES = PolicyRegistry()


def register_policy(name: Union[str, P, None] = None) -> Union[Callable[[P], P], P]:
    """Class decorator adding a :class:`Policy` subclass to :data:`POLICIES`: ``@register_policy("name")``, or bare
    ``@register_policy`` to use the class's ``name`` attribute. Raises TypeError/ValueError as
    :meth:`PolicyRegistry.register`."""
    if inspect.isclass(name):
        cls = name
        return POLICIES.register(cls.__dict__.get("name") or cls.__name__, cls)  # type: ignore[return-value]

    def deco(cls: P) -> P:
        POLICIES.register(name or cls.__dict__.get("name") or cls.__name__, cls)
        return cls

    return deco


def make_policy(name: str, **params) -> Policy:
    """Policy object by registry name with its keyword parameters (see :meth:`PolicyRegistry.create`)."""
    return POLICIES.create(name, **params)


def policy_class(name: str) -> Type[Policy]:
    """The class registered as ``name`` (see :meth:`PolicyRegistry.get_class`)."""
    return POLICIES.get_class(name)


def split_params(names, params: Mapping[str, object]) -> Dict[str, dict]:
    """Share ``params`` among the policies ``names`` (a comparison run): each policy gets the parameters its
    ``Params`` declares. Raises ValueError for an unknown policy and
    :class:`~dlmix.routing.policies.base.PolicyParamError` for a parameter no policy of ``names`` declares, naming
    each policy's valid parameters."""
    from dlmix.routing.policies.base import PolicyParamError

    classes = {n: policy_class(n) for n in names}
    unknown = [k for k in params if not any(k in c.Params.model_fields for c in classes.values())]
    if unknown:
        valid = "; ".join(f"{n}: {', '.join(c.Params.names()) or '(none)'}" for n, c in classes.items())
        raise PolicyParamError(f"unknown policy parameter{'s' if len(unknown) > 1 else ''} "
                               f"{', '.join(map(repr, unknown))}; valid: {valid}")
    return {n: {k: v for k, v in params.items() if k in c.Params.model_fields} for n, c in classes.items()}


__all__ = ["ENTRY_POINT_GROUP", "POLICIES", "PolicyRegistry", "register_policy", "make_policy", "policy_class",
           "split_params"]
