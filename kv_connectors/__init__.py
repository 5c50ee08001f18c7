"""dlmix KV transports (import package ``dlmix_kv_connectors``).

The interface lives in :mod:`dlmix_kv_connectors.base`; build a transport with :func:`make_transport`::

    from dlmix_kv_connectors import make_transport, Segment
    t = make_transport("tcp", name="prefill-0", secret="...")

Kinds: ``tcp`` (built-in, default), ``shm`` (same-host cross-memory attach, TCP fallback), and optional adapters
``mooncake``, ``nixl``, ``dlslime`` (each needs its package; see docs/transports.md). A new kind is one file: a
module of this package named after the kind, or a third-party module declared under the ``dlmix.transports``
entry-point group (:func:`transport_kinds` lists them all).
"""
from .base import (  # noqa: F401
    BUILTIN_KINDS,
    ENTRY_POINT_GROUP,
    NOTIFY_ABORT,
    NOTIFY_BLOCKS_CONSUMED,
    NOTIFY_BLOCKS_READY,
    AuthError,
    GrantError,
    Notification,
    PeerError,
    ProtocolError,
    Range,
    Region,
    Segment,
    TransferCancelled,
    TransferHandle,
    TransferTimeout,
    Transport,
    TransportError,
    UnsupportedMemoryError,
    available_transports,
    make_transport,
    register_transport,
    transport_kinds,
)

__all__ = [
    "BUILTIN_KINDS", "ENTRY_POINT_GROUP", "NOTIFY_ABORT", "NOTIFY_BLOCKS_CONSUMED", "NOTIFY_BLOCKS_READY", "AuthError", "GrantError",
    "Notification", "PeerError", "ProtocolError", "Range", "Region", "Segment", "TransferCancelled", "TransferHandle",
    "TransferTimeout", "Transport", "TransportError", "UnsupportedMemoryError", "available_transports",
    "make_transport", "register_transport", "transport_kinds",
]
