"""Small network-address predicates shared by the router, the engine adapters and their settings."""
from __future__ import annotations

import ipaddress

__all__ = ["is_loopback"]

_LOOPBACK_NAMES = frozenset(("localhost", "ip6-localhost", "ip6-loopback"))


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP literal or a name) is a loopback address: ``127.0.0.0/8``, ``::1`` or one of the
    standard loopback host names (``localhost``, ``ip6-localhost``, ``ip6-loopback``). Other names are not resolved
    (False): a name that needs DNS is not treated as loopback. Never raises."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
