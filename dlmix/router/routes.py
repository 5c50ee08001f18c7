"""Declarative HTTP route tables (method + path pattern -> handler), as starlette's ``Route`` lists.

A pattern is a path with ``{name}`` (one segment) or ``{name:path}`` (the rest, slashes included) parameters; values
are percent-decoded. :meth:`RouteTable.match` answers the handler and parameters, or why nothing matched (404 for an
unknown path, 405 with the allowed methods for a known path). Exact paths are looked up in a dict first, so the
client endpoints cost one dict lookup per request.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from urllib.parse import unquote

__all__ = ["Route", "RouteTable"]

_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::(path))?\}")


class Route:
    """One route: HTTP ``method`` (``GET``/``POST``/...), path ``pattern``, ``handler`` (called as the table's user
    decides, e.g. ``handler(conn, req, **params)``)."""

    __slots__ = ("method", "pattern", "handler", "regex")

    def __init__(self, method: str, pattern: str, handler: Callable):
        self.method = method.upper().encode()
        self.pattern = pattern
        self.handler = handler
        self.regex = None
        if "{" in pattern:
            out, pos = "", 0
            for m in _PARAM.finditer(pattern):
                out += re.escape(pattern[pos:m.start()])
                out += f"(?P<{m.group(1)}>.+)" if m.group(2) else f"(?P<{m.group(1)}>[^/]+)"
                pos = m.end()
            if "{" in pattern[pos:]:
                raise ValueError(f"bad route pattern {pattern!r}: parameters are {{name}} or {{name:path}}")
            self.regex = re.compile("^" + out + re.escape(pattern[pos:]) + "$")

    def __repr__(self) -> str:
        return f"Route({self.method.decode()} {self.pattern})"


class RouteTable:
    """Ordered routes; the first route whose pattern matches the path and whose method matches wins.

    Raises ValueError at construction for a malformed pattern.
    """

    def __init__(self, routes: Sequence[Route]):
        self.routes: List[Route] = list(routes)
        self._exact: Dict[bytes, Dict[bytes, Route]] = {}
        self._patterns: List[Route] = []
        for r in self.routes:
            if r.regex is None:
                self._exact.setdefault(r.pattern.encode(), {}).setdefault(r.method, r)
            else:
                self._patterns.append(r)

    def match(self, method: bytes, path: bytes) -> Tuple[Optional[Route], dict, int]:
        """``(route, params, 0)`` on a match; ``(None, {"allow": [...]}, 405)`` when the path exists under other
        methods; ``(None, {}, 404)`` otherwise. ``path`` is the raw request path without the query."""
        by_method = self._exact.get(path)
        if by_method is not None:
            r = by_method.get(method)
            if r is not None:
                return r, {}, 0
            allow = set(by_method)
        else:
            allow = set()
        if self._patterns:
            s = path.decode("utf-8", "replace")
            for r in self._patterns:
                m = r.regex.match(s)
                if m is None:
                    continue
                if r.method == method:
                    return r, {k: unquote(v) for k, v in m.groupdict().items()}, 0
                allow.add(r.method)
        if allow:
            return None, {"allow": sorted(a.decode() for a in allow)}, 405
        return None, {}, 404
