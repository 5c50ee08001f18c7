"""Chip and link profiles loaded from YAML (``dlmix/data/chips.yaml`` plus user files that add or override chips).

A newcomer adds a chip by editing YAML only; see the schema comment at the top of ``chips.yaml``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Dict, Iterable, Optional, Union

import yaml


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

    @property
    def bytes_per_s(self) -> float:
        """Usable bytes/s = eff × line rate / 8."""
        return self.eff * self.bandwidth_gbps * 1e9 / 8

    def transfer_time(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes: ``setup_ms · 1e-3 + nbytes / bytes_per_s`` (Mooncake FAST'25 §5,
        DistServe OSDI'24 §4.3); 0 bytes cost 0 (nothing to move)."""
        if nbytes <= 0:
            return 0.0
        return self.setup_ms * 1e-3 + nbytes / self.bytes_per_s


@dataclass
class Catalog:
    """Chips and links by name (lookups are case-insensitive and accept aliases)."""

    chips: Dict[str, ChipProfile] = field(default_factory=dict)
    links: Dict[str, LinkProfile] = field(default_factory=dict)
    _alias: Dict[str, str] = field(default_factory=dict)

    def chip(self, name: str) -> ChipProfile:
        """Profile by name or alias. Raises KeyError naming the known chips."""
        key = self._alias.get(str(name).lower())
        if key is None:
            raise KeyError(f"unknown chip {name!r}; known: {', '.join(sorted(self.chips))} (add it to a chips YAML)")
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
        if "bandwidth_gbps" in desc:
            return LinkProfile(str(desc.get("name", "custom")), float(desc["bandwidth_gbps"]),
                               float(desc.get("setup_ms", 2.0)), float(desc.get("eff", 0.8)))
        return self.link(desc.get("link"))

    def add_chip(self, p: ChipProfile) -> None:
        """Add or replace a chip (and its aliases)."""
        self.chips[p.name] = p
        self._alias[p.name.lower()] = p.name
        for a in p.aliases:
            self._alias[str(a).lower()] = p.name


_REQUIRED = ("bf16_tflops", "mem_bw_gbps", "mem_gb")


def _load_into(cat: Catalog, data: dict, origin: str) -> None:
    if not isinstance(data, dict):
        raise CatalogError(f"{origin}: top level must be a mapping with 'chips' and/or 'links'")
    for name, e in (data.get("chips") or {}).items():
        if not isinstance(e, dict):
            raise CatalogError(f"{origin}: chip {name!r} must be a mapping")
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
        try:
            vals = {k: float(merged[k]) for k in ("bf16_tflops", "mem_bw_gbps", "mem_gb")}
            fp16 = float(merged.get("fp16_tflops") or vals["bf16_tflops"])
            mfu = float(merged.get("mfu", 0.5))
            eff = float(merged.get("bw_eff", 0.8))
        except (TypeError, ValueError) as ex:
            raise CatalogError(f"{origin}: chip {name!r} has a non-numeric figure: {ex}") from None
        if min(vals.values()) <= 0 or not (0 < mfu <= 1) or not (0 < eff <= 1):
            raise CatalogError(f"{origin}: chip {name!r}: figures must be > 0, mfu and bw_eff in (0, 1]")
        cat.add_chip(ChipProfile(name=str(base.name if base else name), vendor=str(merged.get("vendor", "")),
                                 fp16_tflops=fp16, mfu=mfu, bw_eff=eff,
                                 confidence=str(merged.get("confidence", "low")),
                                 source=str(merged.get("source", "")),
                                 aliases=tuple(merged.get("aliases") or ()), **vals))
    for name, e in (data.get("links") or {}).items():
        try:
            cat.links[name] = LinkProfile(name, float(e["bandwidth_gbps"]), float(e.get("setup_ms", 2.0)),
                                          float(e.get("eff", 0.8)), str(e.get("source", "")))
        except (KeyError, TypeError, ValueError) as ex:
            raise CatalogError(f"{origin}: link {name!r} is invalid ({ex!r})") from None


def load_catalog(extra: Optional[Iterable[Union[str, Path]]] = None) -> Catalog:
    """Built-in catalog plus ``extra`` YAML files applied in order (a later entry overrides or extends a chip).

    Raises CatalogError for a missing/invalid file or entry.
    """
    cat = Catalog()
    text = resources.files("dlmix").joinpath("data/chips.yaml").read_text()
    _load_into(cat, yaml.safe_load(text), "dlmix/data/chips.yaml")
    for p in extra or ():
        try:
            data = yaml.safe_load(Path(p).read_text())
        except OSError as ex:
            raise CatalogError(f"cannot read chips file {p}: {ex}") from None
        except yaml.YAMLError as ex:
            raise CatalogError(f"{p}: invalid YAML: {ex}") from None
        _load_into(cat, data or {}, str(p))
    return cat
