"""Built-in TCP transport (kind ``"tcp"``, the default): stdlib sockets only.

Zero-copy on both ends: the owner sends a read's bytes with ``sendmsg`` over memoryviews of the registered region and
receives a write's payload with ``recvmsg_into`` straight into the region; the initiator does the same with its local
region. Large transfers are cut into ``chunk_bytes`` frames over ``stripes`` connections; many small KV blocks travel
as one frame of up to ``segs_per_frame`` segments. See :class:`dlmix_kv_connectors._core.Endpoint` for the keywords.
"""
from __future__ import annotations

from ._core import Endpoint
from .base import register_transport


@register_transport("tcp")
class TcpTransport(Endpoint):
    """dlmix's default transport: authenticated TCP, grants enforced by the owner, payload in the frames."""
