"""Small network-address predicates shared by the router, the engine adapters and their settings."""
from __future__ import annotations

import ipaddress
from typing import Optional, Union

__all__ = ["ip_literal", "is_loopback", "url_host"]

_LOOPBACK_NAMES = frozenset(("localhost", "ip6-localhost", "ip6-loopback"))


def ip_literal(host: str) -> Optional[Union[ipaddress.IPv4Address, ipaddress.IPv6Address]]:
    """The address ``host`` denotes when it is an IP literal in any form the system resolver accepts, else None (a
    name, not resolved here).

    Accepted: dotted quads, IPv6 with or without brackets and zone (``[fe80::1%eth0]``), the legacy IPv4 forms that
    ``inet_aton`` takes (``127.1``, ``2130706433``, ``0x7f000001``, octal), and an IPv4-mapped IPv6 address, which is
    unwrapped to its IPv4 address (``::ffff:127.0.0.1`` -> ``127.0.0.1``). Never raises."""
    import socket

    h = host.strip("[]").split("%")[0].lower()
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        if not h or not all(c in "0123456789abcdefx." for c in h):
            return None
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(h))
        except OSError:
            return None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip


def is_loopback(host: str) -> bool:
    """True when ``host`` (an IP literal or a name) is a loopback address: ``127.0.0.0/8`` or ``::1`` in any spelling
    :func:`ip_literal` accepts (``127.1``, ``::ffff:127.0.0.1``, ...), or one of the standard loopback host names
    (``localhost``, ``ip6-localhost``, ``ip6-loopback``, in any case). Other names are not resolved (False): a name
    that needs DNS is not treated as loopback, ``localhost.`` included (``/etc/hosts`` does not match the root's
    trailing dot, so the resolver asks DNS for it). Never raises."""
    if host.lower() in _LOOPBACK_NAMES:
        return True
    ip = ip_literal(host)
    return ip is not None and ip.is_loopback


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


class _SSELines:
    """Incremental UTF-8 decoding plus :func:`sse_split`: ``feed(chunk)`` returns the lines a chunk completes,
    ``close()`` the rest of the stream."""

    def __init__(self) -> None:
        import codecs

        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._rest = ""

    def feed(self, chunk: bytes) -> list:
        lines, self._rest = sse_split(self._rest, self._dec.decode(chunk))
        return lines

    def close(self) -> list:
        lines, rest = sse_split(self._rest, self._dec.decode(b"", final=True))
        rest = rest.rstrip("\r")
        return lines + ([rest] if rest else [])


def iter_sse_lines(response):
    """Lines of a streaming ``httpx.Response`` split at SSE line ends only (:func:`sse_split`)."""
    d = _SSELines()
    for chunk in response.iter_bytes():
        yield from d.feed(chunk)
    yield from d.close()


async def aiter_sse_lines(response):
    """Async :func:`iter_sse_lines` for ``httpx.AsyncClient`` streams."""
    d = _SSELines()
    async for chunk in response.aiter_bytes():
        for ln in d.feed(chunk):
            yield ln
    for ln in d.close():
        yield ln


def sse_lines(text: str) -> list:
    """All lines of a complete SSE body, split as :func:`sse_split` does."""
    lines, rest = sse_split("", text)
    rest = rest.rstrip("\r")
    return lines + ([rest] if rest else [])


#: largest core id :func:`parse_cpus` accepts (Linux' CONFIG_NR_CPUS is at most 8192)
MAX_CPU_ID = 65535


def parse_cpus(cpus: str) -> list:
    """Core ids of a core list (``"0"``, ``"0-3"``, ``"0,2-3"``; spaces ignored), sorted, without repeats: the
    syntax of ``cpus:`` in a ``dlmix launch`` file and of ``VLLM_CPU_OMP_THREADS_BIND``.

    Raises ValueError for anything else, a backwards range included."""
    out = set()
    for part in str(cpus).replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"cpus must be a core list like '0', '0-3' or '0,2-3', got {cpus!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b > MAX_CPU_ID:
            raise ValueError(f"cpus: core id {b} in {part!r} is larger than {MAX_CPU_ID}")
        if b < a:
            raise ValueError(f"cpus: range {part!r} runs backwards")
        out.update(range(a, b + 1))
    return sorted(out)
