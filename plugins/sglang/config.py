"""Settings of the SGLang ``dlmix`` transfer backend, read from the environment variable ``DLMIX_SGLANG_CONFIG``
(a JSON object; SGLang's command line has no free-form field for a transfer backend). Example::

    DLMIX_SGLANG_CONFIG='{"transport": "tcp", "hold_timeout_s": 60}' python -m sglang.launch_server ...

Every key is optional; unknown keys are rejected so a typo never falls back to a default silently. Errors are raised
as :class:`DLMixSGLangConfigError` with one line per bad field.
"""
from __future__ import annotations

from typing import Any

from dlmix.pd.settings import RoutedEndpointSettings, load_json_settings

__all__ = ["ENV_VAR", "DLMixSGLangConfigError", "SGLangSettings", "load_settings"]

ENV_VAR = "DLMIX_SGLANG_CONFIG"


class DLMixSGLangConfigError(ValueError):
    """Raised for an invalid ``DLMIX_SGLANG_CONFIG``."""


class SGLangSettings(RoutedEndpointSettings):
    """Validated settings: the endpoint's (:class:`dlmix.pd.settings.EndpointSettings`: transport, host, port,
    shared_secret, connect_timeout_s, io_timeout_s, hold_timeout_s, registration_wait_s, staging_bytes, pull_threads,
    verify_weights) and the router registration's (:class:`dlmix.pd.settings.RoutedEndpointSettings`: router_url,
    router_admin_key, public_url, heartbeat_s, chip_profile, num_chips). With ``router_url`` each instance's
    scheduler (TP rank 0) registers with the router and heartbeats its load and KV usage
    (:mod:`dlmix_sglang.router_hook`), whatever the transfer backend; ``public_url`` defaults to
    ``http://{--host}:{--port}``, ``num_chips`` to the TP size.
    """


def load_settings(raw: str | dict[str, Any] | None = None) -> SGLangSettings:
    """Settings from ``raw`` (JSON text or dict), else from ``$DLMIX_SGLANG_CONFIG``, else defaults.

    Raises:
      DLMixSGLangConfigError: bad JSON, a non-object, or invalid/unknown fields (one line each, plus the keys).
    """
    return load_json_settings(SGLangSettings, ENV_VAR, raw, DLMixSGLangConfigError)
