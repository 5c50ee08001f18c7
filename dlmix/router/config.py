"""Router configuration: a YAML file (``dlmix router --config router.yaml``) whose every key is also a flag
(``--key value``; ``-`` and ``_`` interchangeable; a flag wins over the file).

Example::

    host: 0.0.0.0
    port: 8000
    policy: cost                     # round_robin | least_load | prefix | cost
    policy_params: {itl_target: 0.05, local_max_uncached: 256}
    model_spec: llama-3.1-8b         # preset, HF folder with config.json, or a dict of ModelSpec fields
    chips: [my_chips.yaml]           # extra chip catalogs (add / override profiles)
    tokenizer: null                  # HF tokenizer path/id, "bytes" (tests), or null (approximate char chunks)
    hash_algo: sha256_cbor           # engines' --prefix-caching-hash-algo
    hash_seed: null                  # engines' PYTHONHASHSEED (null = unset there)
    api_keys: []                     # client keys (empty = open)
    admin_key: null                  # admin/registration key (null = admin API from loopback only)
    allow_open: false                # serve a non-loopback host without api_keys (refused otherwise)
    allow_pinning: false             # honour x-dlmix-prefill-instance / x-dlmix-decode-instance request headers
                                     # (pin a request to instances by id: canaries, one PD pair of a mixed fleet);
                                     # off: such a request is refused (400)
    handoff_host: null               # the address SGLang decodes reach this router at for rooms of another engine's
                                     # prefill (dlmix.router.rooms); null = host, or the route to the decode if 0.0.0.0
    metrics_instance_series: 32      # instances (by slot) with their own /metrics series; the rest: instance="_other"
    etcd_endpoints: []               # router replicas: the fleet's shared state in etcd (dlmix.router.shared);
                                     # empty = this router's memory only. Flag: --etcd http://127.0.0.1:2379
    etcd_prefix: /dlmix/default      # key prefix of this fleet in etcd
    etcd_user: null                  # etcd authentication (required for a non-loopback endpoint)
    etcd_password: null
    etcd_ca: null                    # CA bundle for https etcd endpoints
    etcd_allow_open: false           # accept a non-loopback etcd without authentication (e.g. behind a Kubernetes
                                     # NetworkPolicy that admits only the routers); refused otherwise
    instances:
      - {url: "http://10.0.0.1:8000", role: prefill, chip: H100, model: llama, cluster: a,
         transport: {link: rdma-100g}, kv_events: "tcp://10.0.0.1:5557", kv_layout: {...}}
      - {url: "http://10.0.0.2:8000", role: decode, chip: H20, model: llama, cluster: b}

Flags for list keys repeat: ``--instance "url=http://h:8000,role=decode,chip=H20"`` (``instances``),
``--chips FILE``, ``--api-keys KEY``, ``--etcd URL`` (``etcd_endpoints``); ``--policy-param key=value``. The aliases
are :data:`FLAG_ALIASES`; ``dlmix router --help`` lists every flag with :data:`KEY_HELP` (:func:`flag_rows`).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from dlmix.errors import ConfigError as _BaseConfigError
from dlmix.pd.registration import MAX_HEARTBEAT_TTL_S


class ConfigError(_BaseConfigError):
    """Invalid router configuration (message names the key); a :class:`dlmix.errors.ConfigError`."""


@dataclass
class RouterConfig:
    """All router settings; see the module docstring. Times in seconds."""

    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cost"
    policy_params: Dict[str, Any] = field(default_factory=dict)
    instances: List[Dict[str, Any]] = field(default_factory=list)
    model_spec: Any = "llama-3.1-8b"
    chips: List[str] = field(default_factory=list)
    tokenizer: Optional[str] = None
    hash_algo: str = "sha256_cbor"
    hash_seed: Optional[str] = None
    api_keys: List[str] = field(default_factory=list)
    admin_key: Optional[str] = None
    health_interval_s: float = 2.0
    health_timeout_s: float = 1.0
    health_failures: int = 2
    heartbeat_ttl_s: float = 6.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    prefill_timeout_s: float = 60.0
    connect_timeout_s: float = 3.0
    retries: int = 2
    approx_index_capacity: int = 1 << 20
    default_block_size: int = 16
    metrics: bool = True
    metrics_instance_series: int = 32
    fast_path: bool = True
    allow_open: bool = False
    allow_pinning: bool = False
    handoff_host: Optional[str] = None
    # client-side HTTP limits and timeouts (nginx-like defaults; dlmix.router.proxy.Limits)
    max_body_mb: float = 64.0
    max_url_bytes: int = 8192
    max_header_bytes: int = 32768
    max_headers: int = 100
    header_timeout_s: float = 60.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    linger_timeout_s: float = 5.0
    max_connections: int = 4096
    backend_read_timeout_s: float = 600.0
    # router replicas (dlmix.router.shared)
    etcd_endpoints: List[str] = field(default_factory=list)
    etcd_prefix: str = "/dlmix/default"
    etcd_user: Optional[str] = None
    etcd_password: Optional[str] = None
    etcd_ca: Optional[str] = None
    etcd_timeout_s: float = 2.0
    etcd_allow_open: bool = False

    #: numeric keys and the range each must lie in: ``(low, low_inclusive, high)`` (``high`` inclusive, None: no
    #: bound); every one must be finite. ``heartbeat_ttl_s``: etcd's longest lease, as a registration's own TTL.
    _RANGES = {"port": (0, True, 65535), "health_interval_s": (0, False, None), "health_timeout_s": (0, False, None),
               "health_failures": (1, True, None), "heartbeat_ttl_s": (0, True, MAX_HEARTBEAT_TTL_S),
               "breaker_failures": (1, True, None), "breaker_cooldown_s": (0, True, None),
               "prefill_timeout_s": (0, False, None), "connect_timeout_s": (0, False, None),
               "retries": (0, True, None), "approx_index_capacity": (1, True, None),
               "default_block_size": (1, True, None), "metrics_instance_series": (0, True, None),
               "max_body_mb": (0, False, None), "max_url_bytes": (1, True, None), "max_header_bytes": (1, True, None),
               "max_headers": (1, True, None), "header_timeout_s": (0, False, None),
               "body_timeout_s": (0, False, None), "keepalive_timeout_s": (0, False, None),
               "linger_timeout_s": (0, False, None), "max_connections": (1, True, None),
               "backend_read_timeout_s": (0, False, None), "etcd_timeout_s": (0, False, None)}

    def validate(self) -> "RouterConfig":
        """Check every numeric key's type and range (``port`` 0..65535, counts integers, times positive and finite).
        A NaN interval, an infinite body limit or ``--port 99999`` (which the OS takes modulo 65536) would otherwise
        be accepted, crash later with a traceback, or spin. Raises ConfigError naming the key."""
        import math

        names = {f.name: f for f in dataclasses.fields(self)}
        for k, (low, inclusive, high) in self._RANGES.items():
            v = getattr(self, k)
            want_int = names[k].type in ("int", int)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (not want_int or isinstance(v, int))
            ok = ok and math.isfinite(v) and (v >= low if inclusive else v > low)
            if ok and (high is None or v <= high):
                continue
            if k == "port":
                want = "an integer in 0..65535"
            elif ok:  # above its bound
                want = f"at most {high:g}" + (" s (etcd's longest lease)" if k == "heartbeat_ttl_s" else "")
            elif low > 0 or not inclusive:
                want = "a positive number" + (" (an integer)" if want_int else " (finite)")
            else:
                want = "an integer >= 0" if want_int else "a finite number >= 0"
            raise ConfigError(f"router config key {k} must be {want}, got {v!r}")
        return self

    @classmethod
    def flag_names(cls) -> List[str]:
        """Every flag ``apply_flags`` accepts: each key as ``--key-name``, each followed by its aliases."""
        return [n for names, _, _ in flag_rows() for n in names]

    @classmethod
    def from_yaml(cls, path: str | Path) -> "RouterConfig":
        """Load a YAML file. Raises ConfigError for unreadable files or unknown keys."""
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as ex:
            raise ConfigError(f"cannot read router config {path}: {ex}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> "RouterConfig":
        """From a mapping. Raises ConfigError for unknown keys or bad values."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k.replace("-", "_") not in names]
        if unknown:
            raise ConfigError(f"unknown router config key(s): {', '.join(unknown)}; known: {', '.join(names)}")
        cfg = cls()
        for k, v in data.items():
            setattr(cfg, k.replace("-", "_"), _coerce(names[k.replace("-", "_")], v))
        return cfg

    def apply_flags(self, args: List[str]) -> "RouterConfig":
        """Apply ``--key value`` / ``--key=value`` flags. Raises ConfigError for unknown flags or missing values."""
        names = {f.name: f for f in dataclasses.fields(self)}
        i = 0
        while i < len(args):
            a = args[i]
            if not a.startswith("--"):
                raise ConfigError(f"unexpected argument {a!r}")
            flag, eq, v = a.partition("=")
            k = flag[2:].replace("-", "_")
            k = FLAG_ALIASES.get(k, k)
            if k not in names:
                known = self.flag_names()
                near = difflib.get_close_matches(flag.replace("_", "-"), known, n=1)
                raise ConfigError(f"unknown flag {flag}" + (f" (did you mean {near[0]}?)" if near else "")
                                  + "; known: " + ", ".join(known) + " (dlmix router --help describes them)")
            f = names[k]
            if not eq:
                if f.type in ("bool",) and (i + 1 == len(args) or args[i + 1].startswith("--")):
                    v = "true"
                else:
                    i += 1
                    if i == len(args):
                        raise ConfigError(f"flag {flag} needs a value")
                    v = args[i]
            if k == "instances":
                self.instances.append(parse_kv_list(v))
            elif k == "policy_params":
                self.policy_params.update(parse_kv_list(v))
            elif k in ("chips", "api_keys", "etcd_endpoints"):
                getattr(self, k).append(v)
            else:
                setattr(self, k, _coerce(f, yaml.safe_load(v) if v else v))
            i += 1
        return self


#: flag aliases (``--ALIAS`` for the key): the singular names of the repeatable list keys, as the docs use them
FLAG_ALIASES: Dict[str, str] = {"instance": "instances", "policy_param": "policy_params", "chip": "chips",
                                "api_key": "api_keys", "etcd": "etcd_endpoints"}

#: one line per config key, for ``dlmix router --help`` (tests require one for every :class:`RouterConfig` field)
KEY_HELP: Dict[str, str] = {
    "host": "address to listen on",
    "port": "port to listen on",
    "policy": "routing policy: round_robin, least_load, prefix, cost or another registered one",
    "policy_params": "typed policy parameters (repeatable), e.g. itl_target=0.05",
    "instances": "a static instance (repeatable), e.g. url=http://h:8000,role=decode,chip=H20",
    "model_spec": "model of the cost model: a preset name or an HF folder with config.json",
    "chips": "extra chip catalog YAML that adds or overrides profiles (repeatable)",
    "tokenizer": "HF tokenizer path or id, 'bytes' (tests), or null (approximate character chunks)",
    "hash_algo": "prefix block hash algorithm: the engines' (vLLM --prefix-caching-hash-algo)",
    "hash_seed": "the engines' PYTHONHASHSEED (null = unset there)",
    "api_keys": "client API key, Authorization: Bearer KEY (repeatable; none = open)",
    "admin_key": "admin/registration key (null = admin API from loopback peers only)",
    "health_interval_s": "seconds between health checks of each instance",
    "health_timeout_s": "timeout of one health check, seconds",
    "health_failures": "failed health checks in a row that take an instance out of rotation",
    "heartbeat_ttl_s": "default heartbeat TTL of registering instances, seconds (0 = no heartbeats expected)",
    "breaker_failures": "request failures in a row that open an instance's circuit breaker",
    "breaker_cooldown_s": "seconds an open circuit breaker keeps its instance out",
    "prefill_timeout_s": "timeout of a PD prefill leg, seconds (then the leg is placed again)",
    "connect_timeout_s": "backend connect timeout, seconds",
    "retries": "retries of a failed request on another instance (before any byte reached the client)",
    "approx_index_capacity": "blocks the approximate prefix index (prefixes the router sent) remembers",
    "default_block_size": "KV block size (tokens) of an instance that registers none",
    "metrics": "serve GET /metrics (Prometheus)",
    "metrics_instance_series": "instances (by slot) with their own /metrics series; the rest: instance=\"_other\"",
    "fast_path": "forward non-PD requests with callbacks on idle pooled connections (false: coroutine path only)",
    "allow_open": "serve a non-loopback host without api_keys (refused otherwise)",
    "allow_pinning": "honour the x-dlmix-prefill-instance / x-dlmix-decode-instance request headers",
    "handoff_host": "address SGLang decodes reach this router at for cross-engine rooms (null = host)",
    "max_body_mb": "largest request body, MB (larger: 413)",
    "max_url_bytes": "longest request URL, bytes (longer: 414)",
    "max_header_bytes": "largest request head, bytes (larger: 431)",
    "max_headers": "most request header lines (more: 431)",
    "header_timeout_s": "seconds to receive a whole request head (then 408 and close)",
    "body_timeout_s": "seconds to receive a whole request body (then 408 and close)",
    "keepalive_timeout_s": "seconds an idle kept-alive client connection stays open",
    "linger_timeout_s": "seconds a refused request's remaining bytes are drained before the close",
    "max_connections": "open client connections (more: 503)",
    "backend_read_timeout_s": "seconds a backend may stay silent (then 504)",
    "etcd_endpoints": "etcd endpoint of the fleet's shared state for router replicas (repeatable; none = memory)",
    "etcd_prefix": "key prefix of this fleet in etcd",
    "etcd_user": "etcd user (required for a non-loopback endpoint)",
    "etcd_password": "etcd password",
    "etcd_ca": "CA bundle for https etcd endpoints",
    "etcd_timeout_s": "timeout of one etcd call, seconds",
    "etcd_allow_open": "accept a non-loopback etcd without authentication (e.g. behind a NetworkPolicy)",
}

_METAVARS = {"int": "INTEGER", "float": "FLOAT", "bool": "[BOOL]", "str": "TEXT"}


def flag_rows() -> List[tuple]:
    """``(flag names, metavar, help with default)`` per :class:`RouterConfig` field, in field order: the key as
    ``--key-name`` then its :data:`FLAG_ALIASES`. Generated from the dataclass, so ``--help`` lists exactly the flags
    :meth:`RouterConfig.apply_flags` accepts."""
    rows = []
    for f in dataclasses.fields(RouterConfig):
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        names = ["--" + f.name.replace("_", "-")] + ["--" + a.replace("_", "-")
                                                     for a, k in FLAG_ALIASES.items() if k == f.name]
        base = t.replace("Optional[", "").rstrip("]")
        if t.startswith("List"):
            metavar, default = ("K=V,..." if f.name == "instances" else "TEXT"), None
        elif t.startswith("Dict"):
            metavar, default = "K=V,...", None
        else:
            metavar = _METAVARS.get(base, "TEXT")
            default = f.default
            default = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        text = KEY_HELP.get(f.name, "")
        rows.append((names, metavar, text if default is None else f"{text} [default: {default}]"))
    return rows


def parse_kv_list(s: str) -> Dict[str, Any]:
    """``"url=http://h:1,role=decode,transport.link=rdma-100g"`` → dict (values YAML-parsed: numbers, booleans;
    dotted keys nest). A bare first value containing ``://`` is the url. Raises ConfigError."""
    out: Dict[str, Any] = {}
    for part in s.split(","):
        if not part:
            continue
        k, eq, v = part.partition("=")
        if not eq:
            if not out and "://" in part:
                out["url"] = part
                continue
            raise ConfigError(f"expected key=value in {s!r}")
        k = k.strip()
        if k == "url" or k == "kv_events":
            val = v
        else:
            try:
                val = yaml.safe_load(v)
            except yaml.YAMLError:
                val = v
        *path, last = k.split(".")  # transport.link=rdma-100g -> {"transport": {"link": ...}}
        d = out
        for part in path:
            d = d.setdefault(part, {})
            if not isinstance(d, dict):
                raise ConfigError(f"key {k!r} in {s!r} nests under a non-mapping")
        d[last] = val
    return out


def _coerce(f, v):
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    try:
        if v is None:
            return None
        if t == "int":
            return int(v)
        if t == "float":
            return float(v)
        if t == "bool":
            return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
        if t == "str":
            return str(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(.inf)
        raise ConfigError(f"router config key {f.name}: expected {t}, got {v!r}") from None
    if t.startswith("List") and not isinstance(v, list):
        raise ConfigError(f"router config key {f.name}: expected a list, got {v!r}")
    if t.startswith("Dict") and not isinstance(v, dict):
        raise ConfigError(f"router config key {f.name}: expected a mapping, got {v!r}")
    return v
