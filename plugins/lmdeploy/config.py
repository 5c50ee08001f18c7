"""Settings of the LMDeploy ``DLMix`` migration backend, read from the environment variable
``DLMIX_LMDEPLOY_CONFIG`` (a JSON object: LMDeploy's command line has no free-form field for a migration backend).
Example::

    DLMIX_LMDEPLOY_CONFIG='{"transport": "tcp", "hold_timeout_s": 60}' lmdeploy serve api_server ... \\
        --role Prefill --migration-backend DLMix

The fields are the PD endpoint's (:class:`dlmix.pd.settings.EndpointSettings`). Errors are raised as
:class:`DLMixLMDeployConfigError` with one line per bad field.
"""
from __future__ import annotations

from typing import Any

from dlmix.pd.settings import EndpointSettings, load_json_settings

__all__ = ["ENV_VAR", "DLMixLMDeployConfigError", "LMDeploySettings", "load_settings"]

ENV_VAR = "DLMIX_LMDEPLOY_CONFIG"


class DLMixLMDeployConfigError(ValueError):
    """Raised for an invalid ``DLMIX_LMDEPLOY_CONFIG``."""


class LMDeploySettings(EndpointSettings):
    """The endpoint settings of :class:`dlmix.pd.settings.EndpointSettings`; nothing LMDeploy-specific yet."""


def load_settings(raw: str | dict[str, Any] | None = None) -> LMDeploySettings:
    """Settings from ``raw`` (JSON text or dict), else from ``$DLMIX_LMDEPLOY_CONFIG``, else defaults.
    Raises :class:`DLMixLMDeployConfigError`."""
    return load_json_settings(LMDeploySettings, ENV_VAR, raw, DLMixLMDeployConfigError)
