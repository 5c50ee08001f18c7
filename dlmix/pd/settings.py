"""Settings of one engine rank's PD endpoint, shared by every engine adapter, and their loading from a JSON
environment variable (engines' command lines have no free-form field for a transfer backend).

An adapter subclasses :class:`EndpointSettings` for fields of its own and reads them with :func:`load_json_settings`.
Every key is optional; unknown keys are rejected, so a typo never falls back to a default silently.
"""
from __future__ import annotations

import json
import os
from typing import Any, TypeVar

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator,
                      model_validator)

from dlmix.net import is_loopback

__all__ = ["EndpointSettings", "RoutedEndpointSettings", "load_json_settings"]

S = TypeVar("S", bound=BaseModel)


class EndpointSettings(BaseModel):
    """Validated endpoint settings (units in the names: ``_s`` seconds, ``_bytes`` bytes).

    Fields:
      transport: ``dlmix_kv_connectors`` transport kind of each rank's endpoint (``tcp`` default; ``shm``,
        ``mooncake``, ``nixl``, ``dlslime`` when installed; or ``package.module:Class``).
      host: address each rank's endpoint binds to and advertises (default 127.0.0.1).
      port: endpoint port of TP rank 0 (rank r uses ``port + r``); None = any free port (peers learn it from the
        transfer parameters or the connection handshake).
      shared_secret: HMAC secret of the transport (required when ``host`` is not loopback; equal on both sides).
      connect_timeout_s: connecting to a prefill rank (TCP and handshake; an unreachable one fails that request's
        pull after it); io_timeout_s: per-transfer timeout; hold_timeout_s: how long a prefill keeps a finished
        request's blocks for a decode that has not read them; registration_wait_s: how long a read request waits for
        its hold to appear.
      staging_bytes: decode staging region (bytes); larger transfers run in several rounds.
      pull_threads: pulls a decode rank runs at once (the engine adapter's threads, default 4): their connects and
        grant exchanges overlap, so a prefill that does not answer holds up only its own requests, and their staging
        rounds take turns (:class:`dlmix.pd.consumer.Consumer`).
      verify_weights: refuse a peer whose weights fingerprint differs (only a negative-control test turns it off).
    """

    model_config = ConfigDict(extra="forbid")

    transport: str = "tcp"
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

    @field_validator("transport")
    @classmethod
    def _known(cls, kind: str) -> str:
        from dlmix_kv_connectors import transport_kinds

        known = transport_kinds()
        if kind in known or (":" in kind and all(kind.partition(":")[::2])):
            return kind
        raise ValueError(f"unknown transport {kind!r}; known: {', '.join(known)} (or 'package.module:Class')")

    @model_validator(mode="after")
    def _secret(self):
        if not is_loopback(self.host) and not self.shared_secret:
            raise ValueError(f"host={self.host!r} is not a loopback address: set shared_secret so the KV channel is "
                             "authenticated")
        return self


class RoutedEndpointSettings(EndpointSettings):
    """:class:`EndpointSettings` plus how an engine instance registers itself with the dlmix router
    (:class:`dlmix.pd.router_client.RouterClient`):

      router_url: dlmix router base URL (``http://host:port``); when set, the instance registers with the router and
        heartbeats its load and KV usage.
      router_admin_key: bearer key of the router's admin API (optional; without one the router accepts loopback).
      public_url: this instance's OpenAI HTTP URL announced to the router (an adapter may know a default).
      heartbeat_s: seconds between heartbeats.
      chip_profile: dlmix chip profile name announced to the router (e.g. ``cpu-avx512``); num_chips: chips the
        instance spans (default: its TP size).
      instance_id: the id to register under (default: the router names the instance); ``dlmix launch`` passes the
        deployment's instance name.
    """

    router_url: str | None = None
    router_admin_key: str | None = None
    public_url: str | None = None
    heartbeat_s: float = Field(default=2.0, gt=0, allow_inf_nan=False)
    chip_profile: str | None = None
    num_chips: StrictInt | None = Field(default=None, ge=1)
    instance_id: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("router_url", "public_url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {url!r}")
        return url


def load_json_settings(model: type[S], env_var: str, raw: str | dict[str, Any] | None, error: type[Exception]) -> S:
    """``model`` validated from ``raw`` (JSON text or dict), else from ``$env_var``, else defaults.

    Raises ``error`` for bad JSON, a non-object, or invalid/unknown fields (one line each, plus the accepted keys).
    """
    if raw is None:
        raw = os.environ.get(env_var) or "{}"
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise error(f"{env_var} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise error(f"{env_var} must be a JSON object, got {type(raw).__name__}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc']) or '(settings)'}: {err['msg']}" for err in e.errors()]
        raise error(f"invalid {env_var}:\n" + "\n".join(lines) + "\naccepted keys: "
                    + ", ".join(model.model_fields)) from None
