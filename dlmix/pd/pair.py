"""The one PD pair check: can KV produced under one layout be pulled and loaded under another?

Used at three places, always this function: the router's registration (refuse with 409 and the reasons), the consumer
before it claims a request's tokens (the per-request decision), and the producer when a ``want`` arrives (a security
gate: it never grants blocks to a peer whose layout it cannot serve).
"""
from __future__ import annotations

from typing import Any

from dlmix.kv.layout import KVLayout, check_compat

__all__ = ["check_pair", "layout_of"]


def layout_of(d: dict[str, Any] | KVLayout) -> KVLayout:
    """``KVLayout`` from its dict form (or itself). Raises ValueError on a malformed descriptor."""
    if isinstance(d, KVLayout):
        return d
    if not isinstance(d, dict):
        raise ValueError(f"a KV layout must be an object, got {type(d).__name__}")
    return KVLayout.from_dict(d)


def check_pair(src: dict[str, Any] | KVLayout, dst: dict[str, Any] | KVLayout, *, verify_weights: bool = True,
               src_name: str = "prefill", dst_name: str = "decode") -> list[str]:
    """Reasons why KV produced under ``src`` (producer/prefill) cannot be loaded under ``dst`` (consumer/decode);
    ``[]`` = compatible. Never raises.

    Block size, dtype (incl. fp8 scales), arrangement and TP size may differ: the pull path converts with
    :func:`dlmix.kv.convert`, and with different TP sizes each consumer rank reads its KV heads from the producer
    ranks that hold them (:func:`dlmix.kv.plan_heads`). Required: :func:`dlmix.kv.check_compat` (architecture,
    layers, attention kind, KV heads, head size, MLA dims, weights fingerprint unless ``verify_weights`` is False).
    A malformed descriptor gives one reason starting with ``malformed layout descriptor``.
    """
    try:
        s, d = layout_of(src), layout_of(dst)
    except (ValueError, TypeError, OverflowError) as e:
        return [f"malformed layout descriptor: {e}"]
    reasons = list(check_compat(s, d, relax_fingerprint=not verify_weights, src_name=src_name,
                                dst_name=dst_name).reasons)
    return reasons
