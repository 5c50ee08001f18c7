"""Settings of the LMDeploy ``DLMix`` migration backend, read from the environment variable
``DLMIX_LMDEPLOY_CONFIG`` (a JSON object: LMDeploy's command line has no free-form field for a migration backend).
Example::

    DLMIX_LMDEPLOY_CONFIG='{"transport": "tcp", "hold_timeout_s": 60}' lmdeploy serve api_server ... \\
        --role Prefill --migration-backend DLMix

The fields are the PD endpoint's (:class:`dlmix.pd.settings.EndpointSettings`), the router registration's
(:class:`dlmix.pd.settings.RoutedEndpointSettings`; with ``router_url`` the engine registers itself with the dlmix
router and heartbeats its load: :mod:`dlmix_lmdeploy.router_hook`) and ``model_name``. Errors are raised as
:class:`DLMixLMDeployConfigError` with one line per bad field.
"""
from __future__ import annotations

from typing import Any

from pydantic import field_validator, model_validator

from dlmix.pd.settings import RoutedEndpointSettings, load_json_settings

__all__ = ["ENV_VAR", "DLMixLMDeployConfigError", "LMDeploySettings", "load_settings"]

ENV_VAR = "DLMIX_LMDEPLOY_CONFIG"


class DLMixLMDeployConfigError(ValueError):
    """Raised for an invalid ``DLMIX_LMDEPLOY_CONFIG``."""


class LMDeploySettings(RoutedEndpointSettings):
    """:class:`dlmix.pd.settings.RoutedEndpointSettings` and:

      model_name: the model name announced to the router: the api_server's ``--model-name`` (LMDeploy's engine
        process does not see it; default: the model path the engine loaded, which is LMDeploy's default name).
      kv_events_endpoint: ZMQ endpoint (``tcp://host:port``) where the engine publishes its prefix cache's block
        stored/removed events for the router (:mod:`dlmix_lmdeploy.kv_events`; needs ``--enable-prefix-caching``);
        announced in the router registration.

    ``public_url`` has no default here: LMDeploy's engine process does not see the api_server's address, so
    ``router_url`` without ``public_url`` is an error.
    """

    model_name: str | None = None
    kv_events_endpoint: str | None = None

    @field_validator("kv_events_endpoint")
    @classmethod
    def _zmq(cls, ep: str | None) -> str | None:
        if ep is not None and not ep.startswith(("tcp://", "ipc://")):
            raise ValueError(f"must be a ZMQ endpoint (tcp://host:port or ipc://path), got {ep!r}")
        return ep

    @model_validator(mode="after")
    def _public(self):
        if self.router_url and not self.public_url:
            raise ValueError("router_url needs public_url (the api_server's http://host:port): LMDeploy's engine "
                             "process, which registers, does not see the api_server's address")
        return self


def load_settings(raw: str | dict[str, Any] | None = None) -> LMDeploySettings:
    """Settings from ``raw`` (JSON text or dict), else from ``$DLMIX_LMDEPLOY_CONFIG``, else defaults.
    Raises :class:`DLMixLMDeployConfigError`."""
    return load_json_settings(LMDeploySettings, ENV_VAR, raw, DLMixLMDeployConfigError)
