"""Describe an SGLang rank's KV pool as a :class:`dlmix.kv.KVLayout` and view its buffers as tensors.

SGLang hands a transfer backend its MHA pool as raw host/device addresses (``KVArgs``): ``kv_data_ptrs`` = every
layer's K buffer, then every layer's V buffer, each ``[rows, heads, head_dim]`` (NHD, ``rows = size + page_size``,
page ``p`` = rows ``p*page_size .. p*page_size + page_size - 1``), ``kv_item_lens`` = bytes of one page of one buffer
(source: SGLang 0.5 ``mem_cache/memory_pool.py`` ``MHATokenToKVPool.get_contiguous_buf_infos`` and
``disaggregation/prefill.py`` ``_init_kv_manager``). dlmix calls this arrangement ``sglang_nhd``
(:mod:`dlmix.kv.arrangements.sglang`); block ids are SGLang page ids.
"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.kv.layout import DTYPES, canonical_dtype
from dlmix.pd.fingerprint import weights_fingerprint

__all__ = ["ARRANGEMENT", "kv_dtype_name", "model_config", "describe_pool", "host_tensor", "pool_layers"]

ARRANGEMENT = "sglang_nhd"
#: KV dtypes this backend moves (fp8 pools are refused).
_MOVED = ("fp32", "bf16", "fp16")


def kv_dtype_name(kv_cache_dtype: Any, model_dtype: Any = None) -> str:
    """dlmix dtype name (``fp32``/``bf16``/``fp16``) of SGLang's resolved KV cache dtype (a torch dtype or its
    string; ``auto`` means the model dtype). Raises ValueError for fp8 and other dtypes the backend does not move."""
    s = str(kv_cache_dtype)
    if s == "auto" and model_dtype is not None:
        s = str(model_dtype)
    try:
        name = canonical_dtype(s)
    except ValueError:
        name = None
    if name not in _MOVED:
        raise ValueError(f"KV cache dtype {kv_cache_dtype!r} is not supported by the dlmix transfer backend "
                         "(fp32, bf16, fp16)")
    return name


def model_config(model_path: str) -> dict[str, Any]:
    """The model folder's ``config.json`` as a dict ({} when absent or unreadable)."""
    p = Path(model_path) / "config.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def describe_pool(kv_args: Any, *, model_path: str, kv_dtype: str, tp_rank: int, tp_size: int,
                  engine: str = "sglang") -> KVLayout:
    """The :class:`KVLayout` of one SGLang rank (arrangement ``sglang_nhd``) from its ``KVArgs``.

    Args:
      kv_args: SGLang's ``KVArgs`` (``kv_data_ptrs``/``kv_data_lens``/``kv_item_lens`` of K layers then V layers,
        ``kv_head_num`` per rank, ``total_kv_head_num``, ``page_size``).
      model_path: the served model folder (architecture, attention heads, weights fingerprint).
      kv_dtype: ``fp32``/``bf16``/``fp16`` (:func:`kv_dtype_name`).
      tp_rank, tp_size: attention TP rank and size.
    Raises ValueError for pools the backend does not move (MLA, draft models, extra state pools, an odd number of
    buffers, page bytes that do not match heads x head size x dtype).
    """
    if getattr(kv_args, "num_draft_entries", 0):
        raise ValueError("the dlmix transfer backend does not move draft-model (speculative) KV")
    if getattr(kv_args, "state_types", None):
        raise ValueError(f"the dlmix transfer backend moves full-attention KV only, this pool also has "
                         f"{[str(getattr(s, 'value', s)) for s in kv_args.state_types]} state")
    ptrs = list(kv_args.kv_data_ptrs)
    if not ptrs or len(ptrs) % 2:
        raise ValueError(f"expected K then V buffers per layer (MHA pool), got {len(ptrs)} buffers (MLA pools are "
                         "not supported)")
    num_layers = len(ptrs) // 2
    cfg = model_config(model_path)
    cfg = cfg.get("text_config", cfg) if "num_attention_heads" not in cfg else cfg
    cfg_heads = cfg.get("num_key_value_heads", cfg.get("num_attention_heads"))
    # SGLang's decode sets kv_head_num/total_kv_head_num only after building the manager: fall back to the config
    total = getattr(kv_args, "total_kv_head_num", None) or cfg_heads
    heads = getattr(kv_args, "kv_head_num", None) or (int(total) // int(tp_size) if total else None)
    if not heads:
        raise ValueError("KV heads per rank unknown (no kv_head_num in KVArgs and no num_key_value_heads in "
                         f"{model_path}/config.json)")
    heads = int(heads)
    page = int(kv_args.page_size)
    item = int(kv_args.kv_item_lens[0])
    el = DTYPES[kv_dtype]
    if item % (page * heads * el):
        raise ValueError(f"page bytes {item} are not page_size {page} x {heads} heads x {el} B x head size")
    head_size = item // (page * heads * el)
    archs = list(model_config(model_path).get("architectures") or [])
    total = int(total or heads * tp_size)
    attn_heads = int(cfg.get("num_attention_heads", -1))
    ident = ModelIdentity(architecture=archs[0] if archs else "unknown", num_layers=num_layers,
                          num_kv_heads=total, head_size=head_size,
                          attention="mha" if total == attn_heads else "gqa",
                          weights_fingerprint=weights_fingerprint(str(model_path)))
    return KVLayout(model=ident, block_size=page, dtype=kv_dtype, arrangement=ARRANGEMENT, tp_size=int(tp_size),
                    tp_rank=int(tp_rank), engine=f"{engine} {model_path}")


def host_tensor(ptr: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A torch tensor over ``nbytes`` of host memory at address ``ptr`` (no copy; the memory must outlive it).
    Raises ValueError when ``shape`` x dtype size is not ``nbytes``."""
    import torch

    n = 1
    for s in shape:
        n *= int(s)
    el = torch.empty((), dtype=dtype).element_size()
    if n * el != nbytes:
        raise ValueError(f"{nbytes} B at {ptr:#x} is not {tuple(shape)} x {el} B")
    buf = (ctypes.c_uint8 * nbytes).from_address(int(ptr))
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(*shape)


def pool_layers(kv_args: Any, layout: KVLayout) -> list[tuple[Any, Any]]:
    """Per-layer ``(K, V)`` tensors ``[rows, heads_per_rank, head_size]`` over SGLang's pool buffers (host memory:
    this backend runs where the pool is in host memory, e.g. SGLang on CPU)."""
    from dlmix.kv.ops import torch_dtype

    dt = torch_dtype(layout)
    heads = layout.model.num_kv_heads // layout.tp_size
    D = layout.model.head_size
    L = layout.model.num_layers
    el = {"fp32": 4, "bf16": 2, "fp16": 2}[layout.dtype]
    out = []
    for i in range(L):
        pair = []
        for j in (i, L + i):
            nbytes = int(kv_args.kv_data_lens[j])
            rows = nbytes // (heads * D * el)
            pair.append(host_tensor(int(kv_args.kv_data_ptrs[j]), nbytes, dt, (rows, heads, D)))
        out.append(tuple(pair))
    return out
