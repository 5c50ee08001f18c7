"""Settings of the SGLang ``dlmix`` transfer backend, read from the environment variable ``DLMIX_SGLANG_CONFIG``
(a JSON object; SGLang's command line has no free-form field for a transfer backend). Example::

    DLMIX_SGLANG_CONFIG='{"transport": "tcp", "hold_timeout_s": 60}' python -m sglang.launch_server ...

Every key is optional; unknown keys are rejected so a typo never falls back to a default silently. Errors are raised
as :class:`DLMixSGLangConfigError` with one line per bad field.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from dlmix.pd.settings import EndpointSettings, load_json_settings

__all__ = ["ENV_VAR", "DLMixSGLangConfigError", "SGLangSettings", "load_settings"]

ENV_VAR = "DLMIX_SGLANG_CONFIG"


class DLMixSGLangConfigError(ValueError):
    """Raised for an invalid ``DLMIX_SGLANG_CONFIG``."""


class SGLangSettings(EndpointSettings):
    """Validated settings: the endpoint's (:class:`dlmix.pd.settings.EndpointSettings`: transport, host, port,
    shared_secret, io_timeout_s, hold_timeout_s, registration_wait_s, staging_bytes, verify_weights) and:

      router_url: dlmix router base URL (``http://host:port``); when set, each instance's scheduler (TP rank 0)
        registers with the router and heartbeats its load and KV usage (:mod:`dlmix_sglang.router_hook`), whatever
        the transfer backend.
      router_admin_key: bearer key of the router's admin API (optional; without one the router accepts loopback).
      public_url: this instance's OpenAI HTTP URL announced to the router; default ``http://{--host}:{--port}``.
      heartbeat_s: seconds between heartbeats.
      chip_profile: dlmix chip profile name announced to the router (e.g. ``cpu-avx512``); num_chips: chips the
        instance spans (default: its TP size).
    """

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


def load_settings(raw: str | dict[str, Any] | None = None) -> SGLangSettings:
    """Settings from ``raw`` (JSON text or dict), else from ``$DLMIX_SGLANG_CONFIG``, else defaults.

    Raises:
      DLMixSGLangConfigError: bad JSON, a non-object, or invalid/unknown fields (one line each, plus the keys).
    """
    return load_json_settings(SGLangSettings, ENV_VAR, raw, DLMixSGLangConfigError)
