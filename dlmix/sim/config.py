"""Deployment and model configuration of a simulated cluster.

Deployment YAML (a file, or a built-in name: ``dlmix/data/sim_deploy_<name>.yaml``)::

    name: hetero-pd                 # free text
    block_size: 64                  # engine KV block size, tokens (prefix hits count whole blocks of it)
    max_num_batched_tokens: 8192    # chunked-prefill token budget per iteration (vLLM V1)
    max_num_seqs: 256               # running sequences per instance
    gpu_memory_utilization: 0.9     # fraction of chip memory for weights + KV cache
    t_step: 0.002                   # fixed overhead per engine iteration, s
    r0: 0.0                         # fixed overhead per request added to TTFT, s
    link: rdma-100g                 # default KV link (catalog name, or {bandwidth_gbps, setup_ms, eff})
    instances:
      - {chip: H100, count: 2, role: prefill}
      - {chip: H20, count: 2, role: decode, num_chips: 1, link: rdma-100g}
      # optional per group: timing: <calibration profile name or JSON path> (replaces the roofline),
      # num_gpu_blocks: <int> (KV capacity override), router_chip: <chip the router believes it is>,
      # block_size / max_num_batched_tokens / max_num_seqs / t_step overrides.
    slo: {ttft_ms: 2000, itl_ms: 50, pct: 90}   # optional: the SLO the deployment was planned for (``dlmix plan``
                                    # writes it); ``dlmix sim`` judges goodput against it unless --slo-* are given

Roles: ``both`` (aggregated), ``prefill`` (kv_producer), ``decode`` (kv_consumer). KV capacity per instance, when
not given: the cost model's :func:`dlmix.hw.cost.kv_capacity_bytes` (``mem_gb·1e9·num_chips·gpu_memory_utilization −
params·dtype_bytes``) in whole blocks of ``block_size · kv_bytes_per_token_tp(num_chips)`` bytes (replicated KV heads
counted on each rank; a CPU instance is TP 1, :func:`dlmix.hw.cost.kv_tp`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import reduce
from importlib import resources
from math import gcd
from pathlib import Path
from typing import List, Optional, Union

import yaml

from dlmix.errors import ConfigError as _BaseConfigError
from dlmix.hw.cost import PRESETS, ModelSpec, kv_capacity_bytes, kv_tp
from dlmix.hw.profiles import Catalog, load_catalog
from dlmix.routing.state import ROLES

MODEL_ALIASES = {"smollm2": "smollm2-135m", "llama3.1-8b": "llama-3.1-8b", "llama-8b": "llama-3.1-8b",
                 "qwen2.5": "qwen2.5-7b", "qwen3": "qwen3-8b"}


class ConfigError(_BaseConfigError):
    """A deployment or model config is missing or invalid (the message names the file and field)."""


def load_model(name_or_path: Union[str, ModelSpec]) -> ModelSpec:
    """Model shape: a preset name (``llama-3.1-8b``, ``qwen2.5-7b``, ``qwen3-8b``, ``smollm2``/``smollm2-135m``)
    or a Hugging Face ``config.json`` (file or folder). Raises ConfigError."""
    if isinstance(name_or_path, ModelSpec):
        return name_or_path
    key = MODEL_ALIASES.get(str(name_or_path).lower(), str(name_or_path).lower())
    if key in PRESETS:
        return PRESETS[key]
    p = Path(str(name_or_path))
    if p.exists():
        try:
            return ModelSpec.from_hf_config(p)
        except (ValueError, OSError) as ex:
            raise ConfigError(f"model config {p}: {ex}") from None
    raise ConfigError(f"unknown model {name_or_path!r}; presets: {', '.join(PRESETS)} (also "
                      f"{', '.join(MODEL_ALIASES)}) or a config.json path")


@dataclass
class InstanceSpec:
    """One simulated engine instance (after expanding ``count``)."""

    id: str
    chip: str
    role: str = "both"
    num_chips: int = 1
    link: Union[None, str, dict] = None
    block_size: int = 64
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    num_gpu_blocks: Optional[int] = None
    timing: Optional[str] = None
    router_chip: Optional[str] = None
    t_step: float = 0.002
    r0: float = 0.0


@dataclass
class Deployment:
    """A cluster: instances plus defaults. ``gpu_memory_utilization`` sizes KV capacity.

    ``slo_ttft`` / ``slo_itl`` (seconds) and ``slo_pct`` (percent of requests): the file's optional ``slo`` mapping,
    the SLO the deployment was planned for (None when the file has none)."""

    name: str
    instances: List[InstanceSpec]
    gpu_memory_utilization: float = 0.9
    catalog: Catalog = field(default_factory=load_catalog, repr=False)
    slo_ttft: Optional[float] = None
    slo_itl: Optional[float] = None
    slo_pct: Optional[float] = None

    def hash_block(self) -> int:
        """Tokens per hash id of a workload the simulator generates (the synthetic shared prefix): the greatest
        common divisor of the instances' ``block_size`` (their block size when all agree). Every instance's block
        is then a whole number of hash blocks, so each instance hits exactly the whole blocks of its own
        ``block_size`` that a prefix shares (as vLLM counts prefix-cache hits)."""
        return reduce(gcd, (i.block_size for i in self.instances))

    @property
    def disaggregated(self) -> bool:
        """True if any instance has role ``prefill``."""
        return any(i.role == "prefill" for i in self.instances)

    def kv_blocks(self, inst: InstanceSpec, model: ModelSpec) -> int:
        """KV capacity of ``inst`` in blocks (explicit ``num_gpu_blocks`` or from chip memory). Raises ConfigError
        when the weights do not fit, or one block of ``block_size`` tokens does not fit beside them (each says
        which)."""
        if inst.num_gpu_blocks:
            return int(inst.num_gpu_blocks)
        chip = self.catalog.chip(inst.chip)
        free = kv_capacity_bytes(chip, model, inst.num_chips, self.gpu_memory_utilization)
        n = int(free // (inst.block_size * model.kv_bytes_per_token_tp(kv_tp(chip, inst.num_chips))))
        if n < 1:
            if free > 0:  # the weights fit; one block of KV does not
                raise ConfigError(f"instance {inst.id}: one KV block of {inst.block_size} tokens "
                                  f"({inst.block_size * model.kv_bytes_per_token_tp(kv_tp(chip, inst.num_chips)):.3g} "
                                  f"bytes) does not fit in the {free:.3g} bytes left for KV on {inst.num_chips}× "
                                  f"{inst.chip} after the {model.name or 'model'} weights: use a smaller block size")
            raise ConfigError(f"instance {inst.id}: {model.name or 'model'} weights do not fit on "
                              f"{inst.num_chips}× {inst.chip}")
        return n


def check_model(dep: Deployment, model: ModelSpec) -> None:
    """Refuse a deployment whose instances the model cannot run, by the planner's own rule: the engine TP size of
    every instance (:func:`dlmix.hw.cost.kv_tp`: ``num_chips``, 1 on a CPU) must be one of
    :meth:`dlmix.hw.cost.ModelSpec.allowed_tp_sizes` (vLLM and SGLang need the attention heads divisible by TP and
    the KV heads split or replicated evenly). Raises ConfigError naming the instance, its ``num_chips`` and the
    allowed TP sizes."""
    try:
        allowed = model.allowed_tp_sizes()
    except ValueError as ex:
        raise ConfigError(str(ex)) from None
    for inst in dep.instances:
        tp = kv_tp(dep.catalog.chip(inst.chip), inst.num_chips)
        if tp not in allowed:
            raise ConfigError(f"{dep.name}: instance {inst.id}: num_chips {inst.num_chips} (TP {tp}) is not a TP size "
                              f"{model.name or 'the model'} allows: it has {model.q_heads} attention heads and "
                              f"{model.kv_heads} KV heads; vLLM and SGLang run it at TP "
                              f"{', '.join(map(str, allowed))} only")


_GROUP_KEYS = {"chip", "count", "role", "num_chips", "link", "block_size", "max_num_batched_tokens",
               "max_num_seqs", "num_gpu_blocks", "timing", "router_chip", "t_step", "r0", "name"}
_TOP_KEYS = {"name", "block_size", "max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization", "t_step", "r0",
             "link", "instances", "slo"}
#: more simulated instances than this is a typo (each one is simulated, iteration by iteration)
MAX_INSTANCES = 100_000


def deployment_from_dict(d: dict, origin: str = "<dict>", catalog: Optional[Catalog] = None) -> Deployment:
    """Build a :class:`Deployment` from a parsed YAML mapping. Raises ConfigError naming ``origin`` and the field."""
    if not isinstance(d, dict) or not isinstance(d.get("instances"), list) or not d["instances"]:
        raise ConfigError(f"{origin}: needs a non-empty 'instances' list")
    bad = set(d) - _TOP_KEYS
    if bad:
        raise ConfigError(f"{origin}: unknown keys {sorted(bad)}; known: {', '.join(sorted(_TOP_KEYS))}")
    cat = catalog or load_catalog()
    defaults = {k: d[k] for k in ("block_size", "max_num_batched_tokens", "max_num_seqs", "t_step", "r0", "link")
                if k in d}
    out: List[InstanceSpec] = []
    for gi, g in enumerate(d["instances"]):
        if not isinstance(g, dict) or "chip" not in g:
            raise ConfigError(f"{origin}: instances[{gi}] must be a mapping with 'chip'")
        bad = set(g) - _GROUP_KEYS
        if bad:
            raise ConfigError(f"{origin}: instances[{gi}] has unknown keys {sorted(bad)}")
        try:  # the catalog's own name, whatever the spelling or alias (instance ids and reports use it)
            g = {**g, "chip": cat.chip(g["chip"]).name}
            if g.get("router_chip"):
                g["router_chip"] = cat.chip(g["router_chip"]).name
        except KeyError as ex:
            raise ConfigError(f"{origin}: instances[{gi}]: {ex.args[0]}") from None
        role = g.get("role", "both")
        if role not in ROLES:
            raise ConfigError(f"{origin}: instances[{gi}]: role must be one of {ROLES}, got {role!r}")
        try:
            count = int(g.get("count", 1))
            merged = dict(defaults)
            merged.update({k: v for k, v in g.items() if k not in ("count", "name")})
            for k in ("num_chips", "block_size", "max_num_batched_tokens", "max_num_seqs"):
                if k in merged:
                    merged[k] = int(merged[k])
                    if merged[k] < 1:
                        raise ValueError(f"{k} must be >= 1")
            if merged.get("num_gpu_blocks") is not None:
                merged["num_gpu_blocks"] = int(merged["num_gpu_blocks"])
                if merged["num_gpu_blocks"] < 1:
                    raise ValueError("num_gpu_blocks must be >= 1")
            for k in ("t_step", "r0"):
                if k in merged:
                    merged[k] = float(merged[k])
                    if not 0 <= merged[k] < float("inf"):
                        raise ValueError(f"{k} must be a finite number >= 0 (seconds), got {merged[k]:g}")
        except (TypeError, ValueError) as ex:
            raise ConfigError(f"{origin}: instances[{gi}]: {ex}") from None
        if count < 1 or len(out) + count > MAX_INSTANCES:
            raise ConfigError(f"{origin}: instances[{gi}]: count must be >= 1 and the deployment at most "
                              f"{MAX_INSTANCES} instances, got {count}")
        if merged.get("link") is not None:
            try:
                cat.link(merged["link"]).check()
            except KeyError as ex:
                raise ConfigError(f"{origin}: instances[{gi}]: {ex.args[0]}") from None
            except (TypeError, ValueError) as ex:
                raise ConfigError(f"{origin}: instances[{gi}]: link: {ex}") from None
        if merged.get("timing"):
            from dlmix.sim.timing import LinearTiming

            try:
                LinearTiming.load(str(merged["timing"]))
            except (OSError, ValueError, TypeError, AttributeError) as ex:
                raise ConfigError(f"{origin}: instances[{gi}]: timing: {ex}") from None
        base = g.get("name") or f"{g['chip']}-{role}"
        for k in range(count):
            out.append(InstanceSpec(id=f"{base}-{len(out)}", **merged))
    if any(i.role == "prefill" for i in out) and not any(i.role != "prefill" for i in out):
        raise ConfigError(f"{origin}: prefill-role instances need at least one decode/both instance")
    try:
        gmu = float(d.get("gpu_memory_utilization", 0.9))
    except (TypeError, ValueError):
        raise ConfigError(f"{origin}: gpu_memory_utilization must be a number") from None
    if not 0 < gmu <= 1:
        raise ConfigError(f"{origin}: gpu_memory_utilization must be in (0, 1], got {gmu:g}")
    ttft, itl, pct = _parse_slo(d.get("slo"), origin)
    return Deployment(str(d.get("name", origin)), out, gmu, cat, ttft, itl, pct)


def _parse_slo(slo, origin: str):
    """``(ttft_s, itl_s, pct)`` from a deployment's optional ``slo: {ttft_ms, itl_ms, pct}`` (missing keys: None).
    Raises ConfigError for a non-mapping, unknown keys, non-numbers, targets <= 0 or pct outside (0, 100]."""
    if slo is None:
        return None, None, None
    if not isinstance(slo, dict):
        raise ConfigError(f"{origin}: slo must be a mapping {{ttft_ms, itl_ms, pct}}")
    bad = set(slo) - {"ttft_ms", "itl_ms", "pct"}
    if bad:
        raise ConfigError(f"{origin}: slo has unknown keys {sorted(bad)} (ttft_ms, itl_ms, pct)")
    vals = {}
    for k in ("ttft_ms", "itl_ms", "pct"):
        if slo.get(k) is None:
            vals[k] = None
            continue
        try:
            v = float(slo[k])
        except (TypeError, ValueError):
            raise ConfigError(f"{origin}: slo.{k} must be a number, got {slo[k]!r}") from None
        if not 0 < v < float("inf") or (k == "pct" and v > 100):
            raise ConfigError(f"{origin}: slo.{k} must be a finite number > 0{' and <= 100' if k == 'pct' else ''}, "
                              f"got {v:g}")
        vals[k] = v
    ms = lambda v: None if v is None else v / 1000.0  # noqa: E731
    return ms(vals["ttft_ms"]), ms(vals["itl_ms"]), vals["pct"]


def load_deployment(name_or_path: Union[str, dict], catalog: Optional[Catalog] = None) -> Deployment:
    """From a YAML file, a built-in name (``dlmix/data/sim_deploy_<name>.yaml``) or a dict. Raises ConfigError."""
    if isinstance(name_or_path, dict):
        return deployment_from_dict(name_or_path, "<dict>", catalog)
    p = Path(str(name_or_path))
    if not p.exists():
        p = Path(str(resources.files("dlmix").joinpath(f"data/sim_deploy_{name_or_path}.yaml")))
    if not p.exists():
        raise ConfigError(f"deployment {name_or_path!r} not found (file or built-in name)")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as ex:
        raise ConfigError(f"{p}: invalid YAML: {ex}") from None
    return deployment_from_dict(data, str(p), catalog)
