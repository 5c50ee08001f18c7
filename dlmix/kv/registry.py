"""The registry of KV cache arrangements (torch-free): one :class:`Arrangement` subclass per memory arrangement.

An arrangement says how one engine lays out one layer's paged KV cache in memory, and nothing else: the per-layer
tensor shape(s) for ``B`` blocks of ``N`` tokens, ``H`` local KV heads and head size ``D``; how to view a layer's
cache as one strided ``[B, N, H, D]`` view per plane (K and V, or the MLA latent); which tensors hold whole blocks
as raw bytes (for identical-layout copies); and any rule on the block size or TP sharding it cannot hold. The
conversion machinery (:mod:`dlmix.kv.transfer`, :mod:`dlmix.kv.wire`) works on those views only, so adding an
arrangement is one file::

    from dlmix.kv.registry import Arrangement, register

    @register("myengine_nhd")
    class MyEngineNHD(Arrangement):
        '''[B, N, H, 2*D] with K in [:D] and V in [D:] (cite the engine file that allocates it).'''

        def layer_shape(self, B, N, H, D):
            return (B, N, H, 2 * D)

        def plane_views(self, cache, N, H, D):
            self.expect_shape(cache, self.layer_shape(cache.shape[0], N, H, D))
            return (cache[..., :D], cache[..., D:])

Third-party packages register theirs without importing dlmix first through the entry-point group
``dlmix.kv_arrangements`` (``name = "package.module"`` or ``"package.module:Class"``): the group is loaded the first
time an unknown arrangement name is looked up or the names are listed.

The methods receive tensors (``torch.Tensor``; a ``(K, V)`` pair for ``separate_kv`` arrangements) whose dtype was
already checked and, for fp8, reinterpreted as ``uint8``; they use tensor methods only (``view``, ``permute``,
``as_strided``, slicing), so this module and the arrangement files import no torch.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

__all__ = [
    "ENTRY_POINT_GROUP",
    "Arrangement",
    "arrangement_names",
    "get_arrangement",
    "register",
    "unregister",
]

#: Entry-point group through which installed distributions add arrangements.
ENTRY_POINT_GROUP = "dlmix.kv_arrangements"


class Arrangement:
    """Base class of a KV cache memory arrangement; subclass it and decorate with :func:`register`.

    Class attributes: ``name`` (set by :func:`register`), ``separate_kv`` (each layer is a ``(K, V)`` tuple of
    tensors), ``latent`` (an MLA latent cache: one plane, no heads), ``block_dim`` (the dimension of a
    single-tensor layer cache that counts blocks, used by the default shape check).

    Subclasses implement :meth:`layer_shape` and :meth:`plane_views`; :meth:`raw_blocks` and
    :meth:`check_layout` have defaults.
    """

    name: str = ""
    separate_kv: bool = False
    latent: bool = False
    block_dim: int = 0

    # ---- torch-free facts ------------------------------------------------------------------------------------
    def layer_shape(self, B: int, N: int, H: int, D: int) -> tuple[int, ...] | tuple[tuple[int, ...], ...]:
        """Shape of one layer's cache for ``B`` blocks (a ``(K shape, V shape)`` pair when ``separate_kv``)."""
        raise NotImplementedError

    def check_layout(self, layout: Any) -> None:
        """Refuse (ValueError with the reason) a :class:`~dlmix.kv.layout.KVLayout` this arrangement cannot hold,
        e.g. a block size its kernels do not support. The default accepts every layout."""

    # ---- tensor views ----------------------------------------------------------------------------------------
    def plane_views(self, cache: Any, N: int, H: int, D: int) -> tuple[Any, ...]:
        """Strided views ``[num_blocks, N, H, D]`` (block, token in block, local head, element) of one layer:
        ``(K, V)``, or ``(latent,)`` with ``H = 1`` for a latent arrangement. The views must alias the cache
        memory. Raises ValueError when ``cache`` does not have this arrangement's shape."""
        raise NotImplementedError

    def raw_blocks(self, cache: Any, N: int, H: int, D: int) -> list[Any]:
        """Tensors whose dim 0 is the block id and whose remaining dims are one block's bytes, together covering
        every byte of a block (K and V in one tensor when the engine stores them so). Used to copy whole blocks
        between identical layouts. Default: the ``(K, V)`` tensors, or the single tensor when ``block_dim`` is
        0."""
        if self.separate_kv:
            return [cache[0], cache[1]]
        if self.block_dim != 0:
            raise NotImplementedError(f"arrangement {self.name!r} must define raw_blocks (block_dim != 0)")
        return [cache]

    # ---- helpers for subclasses ------------------------------------------------------------------------------
    def expect_shape(self, t: Any, want: tuple[int, ...], what: str = "layer cache") -> None:
        """Raise ValueError unless ``tuple(t.shape) == want``."""
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"{self.name} {what} must be {list(want)} (num_blocks first), got {list(t.shape)}")

    def num_blocks_of(self, t: Any) -> int:
        """Blocks held by a single-tensor layer cache (its size along ``block_dim``; -1 when it has fewer dims, so
        that :meth:`expect_shape` then reports the shape)."""
        return int(t.shape[self.block_dim]) if t.dim() > self.block_dim else -1

    def __repr__(self) -> str:
        return f"<KV arrangement {self.name!r}>"


_A = TypeVar("_A", bound=type)
_REGISTRY: dict[str, Arrangement] = {}
_LOCK = threading.Lock()
_entry_points_loaded = False


def register(name: str, *, replace: bool = False) -> Callable[[_A], _A]:
    """Class decorator: register an :class:`Arrangement` subclass under ``name`` (one instance is kept).

    Raises ValueError when ``name`` is empty, not an identifier-like string, or already registered by another class
    (pass ``replace=True`` to override), and TypeError when the class is not an :class:`Arrangement`.
    """
    if not isinstance(name, str) or not name or not name.replace("_", "a").replace("-", "a").isalnum():
        raise ValueError(f"arrangement name must be a non-empty word (letters, digits, _ or -), got {name!r}")

    def deco(cls: _A) -> _A:
        if not (isinstance(cls, type) and issubclass(cls, Arrangement)):
            raise TypeError(f"@register({name!r}) needs an Arrangement subclass, got {cls!r}")
        if not cls.__module__.startswith(_BUILTIN_PKG + "."):
            _load_builtins()  # so that a third-party name clashing with a built-in one is refused here, whatever
            #                   was imported first (else it would take the name, and the built-ins fail to load)
        with _LOCK:
            old = _REGISTRY.get(name)
            if old is not None and not replace and (type(old).__module__, type(old).__qualname__) != (
                    cls.__module__, cls.__qualname__):  # the same class imported again is not a clash
                raise ValueError(f"KV arrangement {name!r} is already registered by {type(old).__module__}."
                                 f"{type(old).__qualname__}")
            inst = cls()
            inst.name = name
            _REGISTRY[name] = inst
        return cls

    return deco


def unregister(name: str) -> None:
    """Remove arrangement ``name`` (tests; a no-op when it is not registered)."""
    with _LOCK:
        _REGISTRY.pop(name, None)


_BUILTIN_PKG = __name__.rpartition(".")[0] + ".arrangements"


def _load_builtins() -> None:
    from . import arrangements  # noqa: F401  (registers the built-in arrangements on import)


def _load_entry_points() -> None:
    """Import every ``dlmix.kv_arrangements`` entry point once. A module value registers by importing it; a class
    value is registered under the entry point's name when the import did not register it already."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    _load_builtins()  # a built-in name is taken whatever was looked up first
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as e:  # a broken plugin must not break every layout lookup
            warnings.warn(f"KV arrangement entry point {ep.name!r} ({ep.value}) failed to load: {e}", stacklevel=2)
            continue
        if isinstance(obj, type) and issubclass(obj, Arrangement):
            taken = _REGISTRY.get(ep.name)
            if taken is None:
                register(ep.name)(obj)
            elif type(taken) is not obj:  # never used: say so, as the transports and policies do
                warnings.warn(f"KV arrangement entry point {ep.name!r} = {ep.value!r} is ignored: {ep.name!r} is "
                              f"taken by {type(taken).__module__}.{type(taken).__qualname__}; publish it under another "
                              "name", RuntimeWarning, stacklevel=2)


def get_arrangement(name: str) -> Arrangement:
    """The registered arrangement ``name``; loads the entry points on a miss. Raises ValueError naming the known
    arrangements when there is none."""
    a = _REGISTRY.get(name)
    if a is None:
        _load_builtins()
        a = _REGISTRY.get(name)
    if a is None:
        _load_entry_points()
        a = _REGISTRY.get(name)
    if a is None:
        raise ValueError(f"unknown arrangement {name!r}; known: {arrangement_names()}")
    return a


def arrangement_names() -> list[str]:
    """Sorted names of every registered arrangement (built-ins and entry points)."""
    _load_builtins()
    _load_entry_points()
    return sorted(_REGISTRY)


class _ArrangementTable(Mapping[str, tuple[bool, bool]]):
    """Live read-only mapping ``name -> (separate_kv, latent)`` over the registry (the former ``ARRANGEMENTS``
    dict of :mod:`dlmix.kv.layout`)."""

    def __getitem__(self, name: str) -> tuple[bool, bool]:
        try:
            a = get_arrangement(name)
        except ValueError:
            raise KeyError(name) from None
        return (a.separate_kv, a.latent)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in arrangement_names()

    def __iter__(self) -> Iterator[str]:
        return iter(arrangement_names())

    def __len__(self) -> int:
        return len(arrangement_names())

    def __repr__(self) -> str:
        return repr(dict(self))


ARRANGEMENT_TABLE: Mapping[str, tuple[bool, bool]] = _ArrangementTable()
