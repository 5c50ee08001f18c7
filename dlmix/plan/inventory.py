"""Chip inventories for ``dlmix plan``: which chips an operator owns, on which hosts, linked how.

Inventory YAML (a file, or a built-in name: ``dlmix/data/plan_inv_<name>.yaml``)::

    name: h100x4-h20x4
    hosts:
      - name: node-a
        chips: {H100: 4}          # catalog chip name (dlmix/data/chips.yaml, aliases accepted) -> count
        link: nvlink              # KV link between instances on this host (default: ``local``)
      - name: node-b
        chips: {H20: 4}
    links:                        # links between hosts (catalog link name or {bandwidth_gbps, setup_ms, eff})
      - {hosts: [node-a, node-b], link: rdma-100g}
    default_link: tcp-25g         # between hosts without an entry in ``links``
    timing:                       # optional: measured engine timing per chip type and instance size (chips),
      cpu-x86: {1: calib_1core.json, 2: calib_2core.json}   # replaces the catalog roofline (dlmix.sim.calibrate)

A *chip group* is one chip type over all hosts that carry it. Tensor parallelism stays inside a host, so a group
supports TP size ``t`` with ``Σ_host ⌊count_host / t⌋`` instances. A group's ``link`` (used for analytic pruning,
before the peers are known) is the fastest link from its hosts to another host (its own host's link when the
inventory has one host): optimistic, so pruning never drops an option a good placement could use. A deployment's
KV link per group is :meth:`Inventory.link_to`: the slowest link between the group's hosts and its peers' hosts.

``timing`` names, per chip type and instance size, a calibration profile of :class:`dlmix.sim.timing.LinearTiming`
(a ``dlmix.sim.calibrate`` JSON, path relative to the inventory file, or a built-in profile name). A chip type with
``timing`` is planned only at the sizes it names (its estimates and simulations use the measured timing instead of
the catalog roofline). For a CPU chip type (catalog vendor ``generic``) a "chip" is a core and an instance of size
``t`` is one engine pinned to ``t`` cores.

Bounds (a larger number is taken for a typo, refused at once rather than planned for hours): at most
:data:`MAX_HOSTS` hosts, :data:`MAX_CHIPS_PER_HOST` chips per host (all types together) and
:data:`MAX_CHIPS` chips in all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dlmix.hw.profiles import Catalog, LinkProfile, load_catalog
from dlmix.sim.timing import LinearTiming

__all__ = ["MAX_CHIPS", "MAX_CHIPS_PER_HOST", "MAX_HOSTS", "InventoryError", "Inventory", "ChipGroup", "load_inventory",
           "builtin_inventories"]


#: inventory bounds (see the module docstring): every instance of a plan is simulated iteration by iteration
MAX_HOSTS = 512
MAX_CHIPS_PER_HOST = 1024
MAX_CHIPS = 4096


class InventoryError(ValueError):
    """An inventory file is missing or invalid (the message names the file and the field)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class HostSpec(_Strict):
    """One host: ``chips`` maps a catalog chip name to a count (>= 1); ``link`` is the intra-host KV link."""

    name: str
    chips: Dict[str, int]
    link: Union[str, Dict[str, float]] = "local"


class LinkSpec(_Strict):
    """A link between two hosts (``hosts: [a, b]``)."""

    hosts: Tuple[str, str]
    link: Union[str, Dict[str, float]]


class InventorySpec(_Strict):
    """Parsed inventory file (see the module docstring)."""

    name: str = "inventory"
    hosts: List[HostSpec] = Field(min_length=1)
    links: List[LinkSpec] = Field(default_factory=list)
    default_link: Union[str, Dict[str, float]] = "tcp-25g"
    timing: Dict[str, Dict[int, str]] = Field(default_factory=dict)


@dataclass(frozen=True)
class ChipGroup:
    """All chips of one type.

    Attributes:
        chip: canonical catalog name. per_host: ``((host, count), ...)`` in inventory order.
        link: the group's KV link descriptor (catalog name or dict), see the module docstring.
        timing: ``((size, profile), ...)``: measured timing profiles per instance size (empty: catalog roofline).
    """

    chip: str
    per_host: Tuple[Tuple[str, int], ...]
    link: Union[str, dict]
    timing: Tuple[Tuple[int, str], ...] = ()

    @property
    def count(self) -> int:
        """Chips in the group."""
        return sum(c for _, c in self.per_host)

    def instances(self, tp: int) -> int:
        """Instances of TP size ``tp`` the group can form (TP within a host)."""
        return sum(c // tp for _, c in self.per_host)

    def tp_sizes(self) -> List[int]:
        """TP sizes (powers of two) that at least one host can hold; with ``timing``, only the sizes it names."""
        mx = max(c for _, c in self.per_host)
        if self.timing:
            return sorted(t for t, _ in self.timing if t <= mx)
        out, t = [], 1
        while t <= mx:
            out.append(t)
            t *= 2
        return out

    def timing_profile(self, tp: int) -> Optional[str]:
        """The timing profile (path or built-in name) of instances of size ``tp``, or None (roofline)."""
        return dict(self.timing).get(tp)


@dataclass
class Inventory:
    """A validated inventory: ``groups`` (one per chip type, inventory order), the catalog it was checked against."""

    name: str
    groups: List[ChipGroup]
    spec: InventorySpec
    catalog: Catalog
    _pair: Dict[frozenset, Union[str, dict]] = field(default_factory=dict, repr=False)

    def between(self, a: str, b: str) -> Union[str, dict]:
        """KV link descriptor between hosts ``a`` and ``b`` (the host's own link when equal)."""
        if a == b:
            return next(h.link for h in self.spec.hosts if h.name == a)
        return self._pair.get(frozenset((a, b)), self.spec.default_link)

    def link_to(self, chip: str, peers: List[str]) -> Union[str, dict]:
        """Slowest link between the hosts of ``chip`` and the hosts of the ``peers`` chip types (its own hosts'
        links when ``peers`` is empty)."""
        mine = [h for h, _ in self.group(chip).per_host]
        other = [h for p in peers for h, _ in self.group(p).per_host] or mine
        cands = [self.between(a, b) for a in mine for b in other]
        return min(cands, key=lambda x: (_link(self.catalog, x).bytes_per_s, -_link(self.catalog, x).setup_ms))

    @property
    def total_chips(self) -> int:
        """All chips of the inventory."""
        return sum(g.count for g in self.groups)

    def group(self, chip: str) -> ChipGroup:
        """Group by chip name or alias. Raises KeyError."""
        name = self.catalog.chip(chip).name
        for g in self.groups:
            if g.chip == name:
                return g
        raise KeyError(f"no {chip} in inventory {self.name}")

    def host_of(self, chip: str) -> List[Tuple[str, int]]:
        """``(host, count)`` of a chip type."""
        return list(self.group(chip).per_host)


def _why(ex: Exception) -> str:
    """The message of ``ex``: a KeyError's own text, not its repr in quotes (``str(KeyError("x"))`` is ``"'x'"``)."""
    return str(ex.args[0]) if isinstance(ex, KeyError) and ex.args else str(ex)


def _link(cat: Catalog, desc) -> LinkProfile:
    """The link profile of ``desc``. Raises KeyError for an unknown name, ValueError for a bandwidth <= 0, an
    ``eff`` outside (0, 1] or a negative ``setup_ms``."""
    return cat.link(desc if isinstance(desc, dict) else str(desc)).check()


def inventory_from_dict(d: dict, origin: str = "<dict>", catalog: Optional[Catalog] = None) -> Inventory:
    """Validate an inventory mapping. Raises InventoryError naming ``origin``, the field and the reason."""
    cat = catalog or load_catalog()
    try:
        spec = InventorySpec.model_validate(d)
    except ValidationError as e:
        msgs = [f"{'.'.join(str(x) for x in err['loc']) or '(top level)'}: "
                f"{'unknown key' if err['type'] == 'extra_forbidden' else err['msg']}" for err in e.errors()]
        raise InventoryError(f"{origin}: " + "; ".join(msgs)) from None
    hosts = [h.name for h in spec.hosts]
    if len(hosts) > MAX_HOSTS:
        raise InventoryError(f"{origin}: hosts: at most {MAX_HOSTS} hosts, got {len(hosts)}")
    if len(set(hosts)) != len(hosts):
        raise InventoryError(f"{origin}: duplicate host names in {hosts}")
    by_chip: Dict[str, List[Tuple[str, int]]] = {}
    for h in spec.hosts:
        if not h.chips:
            raise InventoryError(f"{origin}: host {h.name!r} has no chips")
        for chip, n in h.chips.items():
            try:
                canon = cat.chip(chip).name
            except KeyError as ex:
                raise InventoryError(f"{origin}: host {h.name!r}: {ex.args[0]}") from None
            if int(n) < 1:
                raise InventoryError(f"{origin}: host {h.name!r}: count of {chip} must be >= 1, got {n}")
            if int(n) > MAX_CHIPS_PER_HOST:
                raise InventoryError(f"{origin}: host {h.name!r}: count of {chip} must be in 1..{MAX_CHIPS_PER_HOST}"
                                     f" (at most {MAX_CHIPS_PER_HOST} chips per host), got {n}")
            rows = by_chip.setdefault(canon, [])
            if rows and rows[-1][0] == h.name:  # the same chip under another name (alias) on this host
                rows[-1] = (h.name, rows[-1][1] + int(n))
            else:
                rows.append((h.name, int(n)))
        on_host = sum(int(n) for n in h.chips.values())
        if on_host > MAX_CHIPS_PER_HOST:
            raise InventoryError(f"{origin}: host {h.name!r}: at most {MAX_CHIPS_PER_HOST} chips per host, got "
                                 f"{on_host}")
        try:
            _link(cat, h.link)
        except (KeyError, ValueError, TypeError) as ex:
            raise InventoryError(f"{origin}: host {h.name!r}: link: {_why(ex)}") from None
    total = sum(c for rows in by_chip.values() for _, c in rows)
    if total > MAX_CHIPS:
        raise InventoryError(f"{origin}: hosts: at most {MAX_CHIPS} chips in all, got {total}")
    pair: Dict[frozenset, Union[str, dict]] = {}
    for i, ln in enumerate(spec.links):
        a, b = ln.hosts
        for x in (a, b):
            if x not in hosts:
                raise InventoryError(f"{origin}: links[{i}]: unknown host {x!r}; hosts: {hosts}")
        try:
            _link(cat, ln.link)
        except (KeyError, ValueError, TypeError) as ex:
            raise InventoryError(f"{origin}: links[{i}]: {_why(ex)}") from None
        pair[frozenset((a, b))] = ln.link
    try:
        _link(cat, spec.default_link)
    except (KeyError, ValueError, TypeError) as ex:
        raise InventoryError(f"{origin}: default_link: {_why(ex)}") from None
    host_link = {h.name: h.link for h in spec.hosts}

    def between(a: str, b: str):
        if a == b:
            return host_link[a]
        return pair.get(frozenset((a, b)), spec.default_link)

    timing: Dict[str, Tuple[Tuple[int, str], ...]] = {}
    base = Path(origin).parent if origin not in ("<dict>",) and Path(origin).exists() else Path(".")
    for chip, sizes in spec.timing.items():
        try:
            canon = cat.chip(chip).name
        except KeyError as ex:
            raise InventoryError(f"{origin}: timing: {ex.args[0]}") from None
        if canon not in by_chip:
            raise InventoryError(f"{origin}: timing: no {chip} on any host")
        rows = []
        for size, prof in sorted(sizes.items()):
            if size < 1 or size > max(c for _, c in by_chip[canon]):
                raise InventoryError(f"{origin}: timing.{chip}.{size}: no host holds an instance of {size} {chip}")
            p = Path(prof) if Path(prof).is_absolute() else base / prof
            ref = str(p.absolute()) if p.exists() else prof  # absolute: deploy_sim.yaml is read from anywhere
            try:
                LinearTiming.load(ref)
            except (FileNotFoundError, ValueError, OSError) as ex:
                raise InventoryError(f"{origin}: timing.{chip}.{size}: {ex}") from None
            rows.append((int(size), ref))
        timing[canon] = tuple(rows)
    groups = []
    for chip, per_host in by_chip.items():
        mine = [h for h, _ in per_host]
        cands = [between(a, b) for a in mine for b in hosts if b != a] or [between(a, a) for a in mine]
        fastest = max(cands, key=lambda x: (_link(cat, x).bytes_per_s, -_link(cat, x).setup_ms))
        groups.append(ChipGroup(chip, tuple(per_host), fastest, timing.get(chip, ())))
    return Inventory(spec.name, groups, spec, cat, pair)


def builtin_inventories() -> List[str]:
    """Names of the built-in inventories (``dlmix/data/plan_inv_<name>.yaml``)."""
    d = resources.files("dlmix").joinpath("data")
    return sorted(p.name[len("plan_inv_"):-len(".yaml")] for p in d.iterdir()
                  if p.name.startswith("plan_inv_") and p.name.endswith(".yaml"))


def load_inventory(name_or_path: Union[str, dict, Path], catalog: Optional[Catalog] = None) -> Inventory:
    """From a YAML file, a built-in name (:func:`builtin_inventories`) or a dict. Raises InventoryError."""
    if isinstance(name_or_path, dict):
        return inventory_from_dict(name_or_path, "<dict>", catalog)
    p = Path(str(name_or_path))
    if not p.exists():
        p = Path(str(resources.files("dlmix").joinpath(f"data/plan_inv_{name_or_path}.yaml")))
    if not p.exists():
        raise InventoryError(f"inventory {name_or_path!r} not found (a file, or built-in: "
                             f"{', '.join(builtin_inventories())})")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as ex:
        raise InventoryError(f"{p}: invalid YAML: {ex}") from None
    except (OSError, UnicodeDecodeError) as ex:  # a folder, an unreadable or a binary file
        raise InventoryError(f"cannot read inventory {p}: {ex}") from None
    if not isinstance(data, dict):
        raise InventoryError(f"{p}: top level must be a mapping with 'hosts'")
    return inventory_from_dict(data, str(p), catalog)
