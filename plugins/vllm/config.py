"""Settings of :class:`dlmix_vllm.connector.DLMixConnector`, read from ``kv_connector_extra_config``.

Example (``--kv-transfer-config``)::

    {"kv_connector": "DLMixConnector", "kv_role": "kv_producer",
     "kv_connector_extra_config": {"port": 15600, "hold_timeout_s": 60}}

Every key is optional. Unknown keys are rejected (a typo must not silently fall back to a default).
Validation errors are raised as :class:`DLMixConfigError` with one line per bad field.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError,
                      model_validator)
from dlmix.net import is_loopback as _is_loopback

__all__ = ["DLMixConfigError", "DLMixSettings", "parse_settings"]


def _known_transport(kind: str) -> str:
    """Accept a kind of the transport registry (built-in file, ``dlmix.transports`` entry point, registered class) or
    ``"package.module:Class"``; refuse anything else with the known kinds."""
    from dlmix_kv_connectors import transport_kinds

    known = transport_kinds()
    if kind in known or (":" in kind and all(kind.partition(":")[::2])):
        return kind
    raise ValueError(f"unknown transport {kind!r}; known: {', '.join(known)} (or 'package.module:Class')")


class DLMixConfigError(ValueError):
    """Raised when ``kv_connector_extra_config`` holds an invalid DLMixConnector setting."""


class DLMixSettings(BaseModel):
    """Validated DLMixConnector settings (units in the field names: ``_s`` seconds, ``_bytes`` bytes).

    Fields:
      transport: ``dlmix_kv_connectors`` transport kind each worker runs: ``tcp`` (default, built in), ``shm``
        (same host), ``mooncake``, ``nixl``, ``dlslime`` (need their packages; start-up fails with the transport's
        error when missing), or any kind of the transport registry (``dlmix_kv_connectors.transport_kinds()``).
      host: address the worker's transport endpoint binds to and advertises (default 127.0.0.1).
      port: transport port of TP rank 0 (rank r uses ``port + r``); ``None`` = any free port (peers learn it from
        ``kv_transfer_params``).
      shared_secret: secret for the transport's mutual HMAC authentication. Required when ``host`` is not a
        loopback address. Both instances of a pair need the same secret.
      connect_timeout_s / io_timeout_s: connect and per-transfer timeouts (seconds).
      hold_timeout_s: how long the prefill instance keeps a finished request's KV blocks for a decode instance
        that has not yet read them (then frees them; a later read is refused and decode recomputes).
      registration_wait_s: how long the prefill side channel waits for its worker to learn about a hold that a
        decode instance already asks for (the HTTP reply can overtake the engine's next step).
      staging_bytes: bound on the bytes staged per transfer (wire chunk + its converted copy); large requests are
        streamed in token chunks that fit. Default 64 MiB.
      pull_threads: pulls (and release notices) a decode worker runs at once (default 4). Their connects and grant
        exchanges overlap, so a prefill that does not answer holds up only its own requests; their staging rounds
        take turns (one staging region of ``staging_bytes`` per worker).
      verify_weights: refuse a peer whose model weights fingerprint differs (default True). Only a test should
        turn it off (negative control).
      load_failure_policy: what vLLM does with blocks that failed to load; ``recompute`` (default) sets vLLM's
        ``kv_load_failure_policy`` to recompute on consumers so a dead prefill never fails a request.
      chip_profile: dlmix chip profile name announced to the router (e.g. ``cpu-avx512``).
      router_url: dlmix router base URL (``http://host:port``); when set the scheduler side registers and
        heartbeats in a background thread (needs ``public_url``).
      router_admin_key: bearer key of the router's admin API (optional; without it the router accepts loopback).
      public_url: this instance's OpenAI HTTP URL (``http://host:port``) announced to the router.
      heartbeat_s: router heartbeat period.
      model_name: served model name announced to the router (default: vLLM's served model name).
      debug_dump_dir: when set, the prefill worker writes each held request's raw KV pages (exactly as stored in
        the registered cache) plus the layout descriptor there, and the decode worker the pages of each pull it
        finished without error (``loaded-<req_id>``), for layout and byte checks in tests.
      stats_dir: when set, workers append per-transfer records (JSON lines) there.
    """

    model_config = ConfigDict(extra="forbid")

    transport: Annotated[str, AfterValidator(_known_transport)] = "tcp"
    host: str = "127.0.0.1"
    port: StrictInt | None = Field(default=None, ge=1, le=65535)  # JSON true is not port 1
    shared_secret: str | None = None
    connect_timeout_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    io_timeout_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    hold_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    registration_wait_s: float = Field(default=10.0, ge=0, allow_inf_nan=False)
    staging_bytes: StrictInt = Field(default=64 * 1024 * 1024, ge=64 * 1024)
    pull_threads: StrictInt = Field(default=4, ge=1, le=64)
    verify_weights: StrictBool = True
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    chip_profile: str | None = None
    router_url: str | None = None
    router_admin_key: str | None = None
    public_url: str | None = None
    heartbeat_s: float = Field(default=2.0, gt=0, allow_inf_nan=False)
    model_name: str | None = None
    debug_dump_dir: str | None = None
    stats_dir: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "DLMixSettings":
        if not _is_loopback(self.host) and not self.shared_secret:
            raise ValueError(
                f"host={self.host!r} is not a loopback address: set shared_secret so the KV side channel is "
                "authenticated (every socket must be authenticated or bound to loopback)"
            )
        if self.router_url is not None and not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"router_url must start with http:// or https://, got {self.router_url!r}")
        if self.router_url is not None and not self.public_url:
            raise ValueError("router_url needs public_url (this instance's http://host:port) to register")
        return self


def parse_settings(extra: dict[str, Any] | None) -> DLMixSettings:
    """Validate ``kv_connector_extra_config`` (a dict or None) into :class:`DLMixSettings`.

    Raises:
      DLMixConfigError: with one line per invalid or unknown field and the accepted keys.
    """
    try:
        return DLMixSettings.model_validate(dict(extra or {}))
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"]) or "(settings)"
            lines.append(f"  {loc}: {err['msg']}")
        keys = ", ".join(DLMixSettings.model_fields)
        raise DLMixConfigError(
            "invalid DLMixConnector kv_connector_extra_config:\n" + "\n".join(lines) + f"\naccepted keys: {keys}"
        ) from None
