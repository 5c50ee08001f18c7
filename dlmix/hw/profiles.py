"""Chip and link profiles loaded from YAML (``dlmix/data/chips.yaml`` plus files that add or override chips).

A chip is one YAML file (schema: the comment at the top of ``chips.yaml``; a file may hold several chips and links).
:func:`load_catalog` reads, in this order (a later file overrides or extends a chip of an earlier one):

1. the built-in ``dlmix/data/chips.yaml``;
2. files published by installed packages in the entry-point group ``dlmix.chips`` (:data:`ENTRY_POINT_GROUP`),
   sorted by entry-point name. The entry point names an object that is a path to a YAML file or folder (``str``,
   ``os.PathLike`` or an ``importlib.resources`` Traversable), or a callable returning one::

       [project.entry-points."dlmix.chips"]
       my_npu = "my_pkg:CHIPS_YAML"       # my_pkg/__init__.py: CHIPS_YAML = Path(__file__).with_name("chips.yaml")

3. the paths in the environment variable ``DLMIX_CHIPS`` (:data:`ENV_VAR`), separated by ``os.pathsep``
   (``:`` on Linux); a folder stands for its ``*.yaml``/``*.yml`` files in name order;
4. the ``extra`` files of the caller (the router's ``--chips``).
"""
from __future__ import annotations

import math

import functools
import os
from dataclasses import dataclass, field
from importlib import resources
from importlib.metadata import entry_points
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Union

import yaml

#: Entry-point group of packages that publish chip YAML files.
ENTRY_POINT_GROUP = "dlmix.chips"
#: Environment variable listing extra chip YAML files or folders (``os.pathsep``-separated).
ENV_VAR = "DLMIX_CHIPS"


class CatalogError(ValueError):
    """A catalog file is missing, unreadable, or has a bad entry (message names the file and the chip)."""


@dataclass(frozen=True)
class ChipProfile:
    """Peak figures of one accelerator (per chip).

    Attributes:
        name: catalog key. vendor: vendor name.
        bf16_tflops / fp16_tflops: dense tensor throughput, TFLOP/s (1e12 FLOP/s).
        mem_bw_gbps: memory bandwidth, GB/s (1e9 bytes/s). mem_gb: memory size, GB.
        mfu: achievable fraction of peak FLOP/s for prefill (default 0.5; DistServe/Splitwise report 0.4-0.6).
        bw_eff: achievable fraction of peak bandwidth for decode (default 0.8).
        confidence, source: provenance of the figures.
    """

    name: str
    vendor: str
    bf16_tflops: float
    fp16_tflops: float
    mem_bw_gbps: float
    mem_gb: float
    mfu: float = 0.5
    bw_eff: float = 0.8
    confidence: str = "low"
    source: str = ""
    aliases: tuple = ()

    @property
    def flops(self) -> float:
        """Peak dense BF16 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def mem_bw(self) -> float:
        """Peak memory bandwidth, bytes/s."""
        return self.mem_bw_gbps * 1e9

    @property
    def ridge(self) -> float:
        """Roofline ridge point, FLOP/byte (decode turns compute-bound above it)."""
        return self.flops / self.mem_bw


@dataclass(frozen=True)
class LinkProfile:
    """A KV transfer link: ``bandwidth_gbps`` Gbit/s line rate, ``setup_ms`` per transfer, ``eff`` fraction usable."""

    name: str
    bandwidth_gbps: float
    setup_ms: float = 2.0
    eff: float = 0.8
    source: str = ""

    def check(self) -> "LinkProfile":
        """Return self; raise ValueError naming the link unless ``bandwidth_gbps`` is a finite number > 0,
        ``setup_ms`` a finite number >= 0 and ``eff`` in (0, 1] (transfer times divide by the bandwidth)."""
        if not (math.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0 and math.isfinite(self.setup_ms)
                and self.setup_ms >= 0 and 0 < self.eff <= 1):
            raise ValueError(f"link {self.name!r}: bandwidth_gbps must be > 0, setup_ms >= 0 (both finite) and eff in "
                             f"(0, 1]; got {self.bandwidth_gbps!r}, {self.setup_ms!r}, {self.eff!r}")
        return self

    @property
    def bytes_per_s(self) -> float:
        """Usable bytes/s = eff × line rate / 8."""
        return self.eff * self.bandwidth_gbps * 1e9 / 8

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes: ``setup_ms · 1e-3 + nbytes / bytes_per_s`` (Mooncake FAST'25 §5,
        DistServe OSDI'24 §4.3); 0 bytes cost 0 (nothing to move)."""
        if nbytes <= 0:
            return 0.0
        return self.setup_ms * 1e-3 + nbytes / (self.eff * self.bandwidth_gbps * 1e9 / 8)


@dataclass(frozen=True)
class VendorProfile:
    """How a cluster manager places a vendor's chips (``vendors:`` in the catalog).

    Attributes:
        name: vendor name as chips give it (``ChipProfile.vendor``).
        k8s_resource: extended resource of the vendor's Kubernetes device plugin (``nvidia.com/gpu``,
            ``huawei.com/Ascend910``, ...); None when none is published (CPU, or unknown).
        k8s_node_label: node label whose value names the chip model (value = the chip's catalog name); None = no
            node selector.
        confidence, source: provenance.
    """

    name: str
    k8s_resource: Optional[str] = None
    k8s_node_label: Optional[str] = None
    confidence: str = "medium"
    source: str = ""


@dataclass
class Catalog:
    """Chips, links and vendors by name (chip lookups are case-insensitive and accept aliases)."""

    chips: Dict[str, ChipProfile] = field(default_factory=dict)
    links: Dict[str, LinkProfile] = field(default_factory=dict)
    vendors: Dict[str, VendorProfile] = field(default_factory=dict)
    _alias: Dict[str, str] = field(default_factory=dict)

    def vendor_of(self, chip: str) -> VendorProfile:
        """Vendor placement profile of ``chip`` (name or alias); an empty profile (no resource, no label) for a
        vendor the catalog does not list. Raises KeyError for an unknown chip."""
        v = self.chip(chip).vendor
        return self.vendors.get(v) or VendorProfile(name=v, confidence="low", source="vendor not in the catalog")

    def chip(self, name: str) -> ChipProfile:
        """Profile by name or alias. Raises KeyError naming the known chips."""
        key = self._alias.get(str(name).lower())
        if key is None:
            raise KeyError(f"unknown chip {name!r}; known: {', '.join(sorted(self.chips))} (add it with a chips YAML "
                           "file: --chips FILE, the DLMIX_CHIPS path list or a dlmix.chips entry point)")
        return self.chips[key]

    def link(self, desc: Union[None, str, dict]) -> LinkProfile:
        """Link from a transport descriptor: None → ``tcp-25g``; a name; or a dict with ``link`` or
        ``bandwidth_gbps``/``setup_ms``/``eff``. Raises KeyError for an unknown link name."""
        if desc is None:
            return self.links.get("tcp-25g") or LinkProfile("tcp-25g", 25, 5.0)
        if isinstance(desc, str):
            if desc not in self.links:
                raise KeyError(f"unknown link {desc!r}; known: {', '.join(sorted(self.links))}")
            return self.links[desc]
        if not isinstance(desc, dict):
            raise TypeError(f"a transport is a link name or a mapping with 'link' or 'bandwidth_gbps', got {desc!r}")
        if "bandwidth_gbps" in desc:
            return LinkProfile(str(desc.get("name", "custom")), float(desc["bandwidth_gbps"]),
                               float(desc.get("setup_ms", 2.0)), float(desc.get("eff", 0.8)))
        name = desc.get("link")
        if name is not None and not isinstance(name, str):  # {"link": 5} said "argument of type 'int' is not iterable"
            raise TypeError(f"transport link must be a link name (a string), got {name!r}")
        return self.link(name)

    def add_chip(self, p: ChipProfile) -> None:
        """Add or replace a chip (and its aliases)."""
        self.chips[p.name] = p
        self._alias[p.name.lower()] = p.name
        for a in p.aliases:
            self._alias[str(a).lower()] = p.name


_REQUIRED = ("bf16_tflops", "mem_bw_gbps", "mem_gb")
_CHIP_KEYS = {"vendor", "aliases", "bf16_tflops", "fp16_tflops", "mem_bw_gbps", "mem_gb", "mfu", "bw_eff", "confidence",
              "source"}


_CONFIDENCE = ("high", "medium", "low")


def _figure(origin: str, chip: object, key: str, v: object) -> float:
    """``v`` as a finite float; CatalogError naming the file, the chip and the key otherwise (a bool, a string,
    ``.nan`` or ``.inf`` is not a figure)."""
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise TypeError
        f = float(v)  # a quoted number ("312") is still read as one
    except (TypeError, ValueError):
        raise CatalogError(f"{origin}: chip {chip!r}: {key} must be a number, got {type(v).__name__} {v!r}") from None
    if not math.isfinite(f):
        raise CatalogError(f"{origin}: chip {chip!r}: {key} must be a finite number, got {v!r}")
    return f


def _load_into(cat: Catalog, data: dict, origin: str) -> None:
    if not isinstance(data, dict):
        raise CatalogError(f"{origin}: top level must be a mapping with 'chips' and/or 'links'")
    unknown = set(data) - {"chips", "links", "vendors"}
    if unknown:
        raise CatalogError(f"{origin}: unknown top-level key(s) {', '.join(sorted(map(str, unknown)))} "
                           f"(chips, links, vendors)")
    for name, e in (data.get("chips") or {}).items():
        if not isinstance(e, dict):
            raise CatalogError(f"{origin}: chip {name!r} must be a mapping")
        unknown = set(e) - _CHIP_KEYS
        if unknown:
            raise CatalogError(f"{origin}: chip {name!r} has unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                               f"known: {', '.join(sorted(_CHIP_KEYS))}")
        base = None
        try:
            base = cat.chip(name)
        except KeyError:
            pass
        merged = dict(base.__dict__) if base else {}
        merged.update(e)
        missing = [k for k in _REQUIRED if merged.get(k) in (None, "")]
        if missing:
            raise CatalogError(f"{origin}: chip {name!r} lacks {', '.join(missing)}")
        vals = {k: _figure(origin, name, k, merged[k]) for k in ("bf16_tflops", "mem_bw_gbps", "mem_gb")}
        fp16 = merged.get("fp16_tflops")  # absent: the bf16 figure; 0 is a bad figure, refused below
        fp16 = _figure(origin, name, "fp16_tflops", vals["bf16_tflops"] if fp16 in (None, "") else fp16)
        mfu = _figure(origin, name, "mfu", merged.get("mfu", 0.5))
        eff = _figure(origin, name, "bw_eff", merged.get("bw_eff", 0.8))
        if min(*vals.values(), fp16) <= 0 or not (0 < mfu <= 1) or not (0 < eff <= 1):  # fp16_tflops too
            raise CatalogError(f"{origin}: chip {name!r}: figures must be > 0, mfu and bw_eff in (0, 1]")
        for key in ("vendor", "source"):
            if key in e and not isinstance(e[key], str):
                raise CatalogError(f"{origin}: chip {name!r}: {key} must be a string, got {type(e[key]).__name__} "
                                   f"{e[key]!r}")
        conf = merged.get("confidence", "low")
        if conf not in _CONFIDENCE:
            raise CatalogError(f"{origin}: chip {name!r}: confidence must be one of {', '.join(_CONFIDENCE)}, "
                               f"got {conf!r}")
        aliases = merged.get("aliases") or ()
        if not isinstance(aliases, (list, tuple)) or not all(isinstance(a, (str, int)) and not isinstance(a, bool)
                                                             for a in aliases):
            raise CatalogError(f"{origin}: chip {name!r}: aliases must be a list of names, got {aliases!r}")
        own = base.name if base else str(name)
        for a in aliases:  # an alias must not silently take over another chip's name or alias
            other = cat._alias.get(str(a).lower())
            if other is not None and other != own:
                raise CatalogError(f"{origin}: chip {name!r}: alias {a!r} already names chip {other!r}; to change "
                                   f"{other!r}, give an entry named {other!r}")
        cat.add_chip(ChipProfile(name=str(own), vendor=str(merged.get("vendor", "")),
                                 fp16_tflops=fp16, mfu=mfu, bw_eff=eff, confidence=str(conf),
                                 source=str(merged.get("source", "")),
                                 aliases=tuple(aliases), **vals))
    for name, e in (data.get("vendors") or {}).items():
        if not isinstance(e, dict):
            raise CatalogError(f"{origin}: vendor {name!r} must be a mapping")
        unknown = set(e) - {"k8s_resource", "k8s_node_label", "confidence", "source"}
        if unknown:
            raise CatalogError(f"{origin}: vendor {name!r} has unknown key(s) {', '.join(sorted(unknown))}")
        res, lab = e.get("k8s_resource"), e.get("k8s_node_label")
        cat.vendors[str(name)] = VendorProfile(str(name), None if res is None else str(res),
                                               None if lab is None else str(lab),
                                               str(e.get("confidence", "medium")), str(e.get("source", "")))
    for name, e in (data.get("links") or {}).items():
        try:
            ln = LinkProfile(name, float(e["bandwidth_gbps"]), float(e.get("setup_ms", 2.0)),
                             float(e.get("eff", 0.8)), str(e.get("source", "")))
        except (KeyError, TypeError, ValueError) as ex:
            raise CatalogError(f"{origin}: link {name!r} is invalid ({ex!r})") from None
        try:
            cat.links[name] = ln.check()
        except ValueError as ex:
            raise CatalogError(f"{origin}: {ex}") from None


@functools.lru_cache(maxsize=1)
def _builtin() -> dict:
    return yaml.safe_load(resources.files("dlmix").joinpath("data/chips.yaml").read_text())


def _expand(p: Path, origin: str) -> List[Path]:
    """A YAML file, or a folder's ``*.yaml``/``*.yml`` files in name order. Raises CatalogError if missing."""
    if p.is_dir():
        return sorted(q for q in p.iterdir() if q.suffix in (".yaml", ".yml") and q.is_file())
    if not p.exists():
        raise CatalogError(f"chips file {p} (from {origin}) does not exist")
    return [p]


def plugin_chip_files() -> List[tuple]:
    """``(path, origin)`` of the chip files of the ``dlmix.chips`` entry points (by name) and of ``DLMIX_CHIPS``.

    Raises CatalogError naming the entry point or variable whose value is unusable (fails to import, is not a path,
    names a missing file)."""
    out = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        origin = f"entry point {ENTRY_POINT_GROUP}:{ep.name} ({ep.value})"
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, (str, os.PathLike)):
                obj = obj()
        except Exception as ex:
            raise CatalogError(f"{origin} failed to load: {type(ex).__name__}: {ex}") from None
        if isinstance(obj, (str, os.PathLike)):
            path = Path(obj)
        elif hasattr(obj, "is_file") and hasattr(obj, "read_text"):  # importlib.resources Traversable
            path = Path(str(obj))
        else:
            raise CatalogError(f"{origin} must name a YAML path (str, PathLike or Traversable), got {type(obj).__name__}")
        out += [(q, origin) for q in _expand(path, origin)]
    for part in filter(None, os.environ.get(ENV_VAR, "").split(os.pathsep)):
        out += [(q, f"${ENV_VAR}") for q in _expand(Path(part), f"${ENV_VAR}")]
    return out


def load_catalog(extra: Optional[Iterable[Union[str, Path]]] = None) -> Catalog:
    """Built-in catalog, then the plugin files (``dlmix.chips`` entry points, ``DLMIX_CHIPS``; see the module
    docstring), then ``extra`` YAML files, applied in order (a later entry overrides or extends a chip).

    Raises CatalogError for a missing/invalid file or entry (the message names the file and its origin).
    """
    cat = Catalog()
    _load_into(cat, _builtin(), "dlmix/data/chips.yaml")
    files = plugin_chip_files() + [(Path(p), "extra") for p in extra or ()]
    for p, origin in files:
        try:
            data = yaml.safe_load(Path(p).read_text())
        except OSError as ex:
            raise CatalogError(f"cannot read chips file {p} (from {origin}): {ex}") from None
        except yaml.YAMLError as ex:
            raise CatalogError(f"{p}: invalid YAML: {ex}") from None
        _load_into(cat, data or {}, str(p))
    return cat
