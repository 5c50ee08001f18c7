"""Small network-address predicates shared by the router, the engine adapters and their settings."""
from __future__ import annotations

import ipaddress

__all__ = ["is_loopback", "url_host"]

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


def url_host(host: str) -> str:
    """The host part of a URL that reaches a server bound to ``host`` from the same machine: a wildcard bind address
    becomes loopback (``0.0.0.0`` -> ``127.0.0.1``, ``::`` -> ``[::1]``; a wildcard is no address to connect to), an
    IPv6 literal gets its brackets (``fe80::1`` -> ``[fe80::1]``), anything else (names, IPv4, ``$(POD_IP)``) is
    returned as it is. Never raises."""
    h = host.strip("[]")
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return host
    if ip.is_unspecified:
        return "127.0.0.1" if ip.version == 4 else "[::1]"
    return f"[{h}]" if ip.version == 6 else h


def sse_split(buffer: str, text: str) -> tuple:
    """Split server-sent-event text into complete lines at the SSE line ends only (CRLF, LF, CR: WHATWG HTML §9.2),
    never at the other Unicode line boundaries that ``str.splitlines`` and httpx's ``iter_lines`` also break on
    (U+0085, U+2028, U+2029, \\x1c-\\x1e, \\x0b, \\x0c), which a model's output may contain unescaped in a JSON
    chunk.

    Args:
        buffer: the unterminated tail left by the previous call ("" at the start). text: newly decoded text.
    Returns ``(lines, rest)``: the complete lines, without their line ends, and the new unterminated tail (a
    trailing CR is kept in it, as it may be the first half of CRLF).
    """
    s = buffer + text
    lines = []
    start = i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\n":
            lines.append(s[start:i])
            start = i + 1
        elif c == "\r":
            if i + 1 == n:
                break  # may be CRLF split across two reads
            lines.append(s[start:i])
            start = i + 2 if s[i + 1] == "\n" else i + 1
            i = start - 1
        i += 1
    return lines, s[start:]


def iter_sse_lines(response):
    """Lines of a streaming ``httpx.Response`` split at SSE line ends only (:func:`sse_split`)."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("replace")
    rest = ""
    for chunk in response.iter_bytes():
        lines, rest = sse_split(rest, dec.decode(chunk))
        yield from lines
    lines, rest = sse_split(rest, dec.decode(b"", final=True))
    yield from lines
    if rest.rstrip("\r"):
        yield rest.rstrip("\r")


async def aiter_sse_lines(response):
    """Async :func:`iter_sse_lines` for ``httpx.AsyncClient`` streams."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")("replace")
    rest = ""
    async for chunk in response.aiter_bytes():
        lines, rest = sse_split(rest, dec.decode(chunk))
        for ln in lines:
            yield ln
    lines, rest = sse_split(rest, dec.decode(b"", final=True))
    for ln in lines:
        yield ln
    if rest.rstrip("\r"):
        yield rest.rstrip("\r")


def sse_lines(text: str) -> list:
    """All lines of a complete SSE body, split as :func:`sse_split` does."""
    lines, rest = sse_split("", text)
    rest = rest.rstrip("\r")
    return lines + ([rest] if rest else [])
