"""Settings of the SGLang ``dlmix`` transfer backend, read from the environment variable ``DLMIX_SGLANG_CONFIG``
(a JSON object; SGLang's command line has no free-form field for a transfer backend). Example::

    DLMIX_SGLANG_CONFIG='{"transport": "tcp", "hold_timeout_s": 60}' python -m sglang.launch_server ...

Every key is optional; unknown keys are rejected so a typo never falls back to a default silently. Errors are raised
as :class:`DLMixSGLangConfigError` with one line per bad field.
"""
from __future__ import annotations

import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from dlmix.net import is_loopback as _is_loopback

__all__ = ["ENV_VAR", "DLMixSGLangConfigError", "SGLangSettings", "load_settings"]

ENV_VAR = "DLMIX_SGLANG_CONFIG"


class DLMixSGLangConfigError(ValueError):
    """Raised for an invalid ``DLMIX_SGLANG_CONFIG``."""


class SGLangSettings(BaseModel):
    """Validated settings (units in the names: ``_s`` seconds, ``_bytes`` bytes).

    Fields:
      transport: ``dlmix_kv_connectors`` transport kind of each rank's endpoint (``tcp`` default; ``shm``,
        ``mooncake``, ``nixl``, ``dlslime`` when installed).
      host: address each rank's endpoint binds to and advertises (default 127.0.0.1).
      port: endpoint port of attention-TP rank 0 (rank r uses ``port + r``); None = any free port (peers learn it
        from the transfer parameters).
      shared_secret: HMAC secret of the transport (required when ``host`` is not loopback; equal on both sides).
      io_timeout_s: per-transfer timeout; hold_timeout_s: how long a prefill keeps a finished request's pages for a
        decode that has not read them; registration_wait_s: how long a read request waits for its hold to appear.
      staging_bytes: decode staging region (bytes); larger transfers run in several rounds.
      verify_weights: refuse a peer whose weights fingerprint differs (only a negative-control test turns it off).
      router_url: dlmix router base URL (``http://host:port``); when set, each instance's scheduler (TP rank 0)
        registers with the router and heartbeats its load and KV usage (:mod:`dlmix_sglang.router_hook`), whatever
        the transfer backend.
      router_admin_key: bearer key of the router's admin API (optional; without one the router accepts loopback).
      public_url: this instance's OpenAI HTTP URL announced to the router; default ``http://{--host}:{--port}``.
      heartbeat_s: seconds between heartbeats.
      chip_profile: dlmix chip profile name announced to the router (e.g. ``cpu-avx512``); num_chips: chips the
        instance spans (default: its TP size).
    """

    model_config = ConfigDict(extra="forbid")

    transport: str = "tcp"
    host: str = "127.0.0.1"
    port: int | None = Field(default=None, ge=1, le=65535)
    shared_secret: str | None = None
    io_timeout_s: float = Field(default=60.0, gt=0)
    hold_timeout_s: float = Field(default=120.0, gt=0)
    registration_wait_s: float = Field(default=10.0, ge=0)
    staging_bytes: int = Field(default=64 * 1024 * 1024, ge=64 * 1024)
    verify_weights: bool = True
    router_url: str | None = None
    router_admin_key: str | None = None
    public_url: str | None = None
    heartbeat_s: float = Field(default=2.0, gt=0)
    chip_profile: str | None = None
    num_chips: int | None = Field(default=None, ge=1)

    @field_validator("router_url", "public_url")
    @classmethod
    def _http(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {url!r}")
        return url

    @field_validator("transport")
    @classmethod
    def _known(cls, kind: str) -> str:
        from dlmix_kv_connectors import transport_kinds

        known = transport_kinds()
        if kind in known or (":" in kind and all(kind.partition(":")[::2])):
            return kind
        raise ValueError(f"unknown transport {kind!r}; known: {', '.join(known)} (or 'package.module:Class')")

    @model_validator(mode="after")
    def _secret(self) -> "SGLangSettings":
        if not _is_loopback(self.host) and not self.shared_secret:
            raise ValueError(f"host={self.host!r} is not a loopback address: set shared_secret so the KV channel is "
                             "authenticated")
        return self


def load_settings(raw: str | dict[str, Any] | None = None) -> SGLangSettings:
    """Settings from ``raw`` (JSON text or dict), else from ``$DLMIX_SGLANG_CONFIG``, else defaults.

    Raises:
      DLMixSGLangConfigError: bad JSON, a non-object, or invalid/unknown fields (one line each, plus the keys).
    """
    if raw is None:
        raw = os.environ.get(ENV_VAR) or "{}"
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise DLMixSGLangConfigError(f"{ENV_VAR} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise DLMixSGLangConfigError(f"{ENV_VAR} must be a JSON object, got {type(raw).__name__}")
    try:
        return SGLangSettings.model_validate(raw)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc']) or '(settings)'}: {err['msg']}" for err in e.errors()]
        raise DLMixSGLangConfigError(f"invalid {ENV_VAR}:\n" + "\n".join(lines) + "\naccepted keys: "
                                     + ", ".join(SGLangSettings.model_fields)) from None
