"""dlmix adapter for vLLM (import name ``dlmix_vllm``; directory ``plugins/vllm``).

Installing dlmix next to vLLM is enough: vLLM runs the ``vllm.general_plugins`` entry point ``dlmix =
"dlmix_vllm:register"`` in each of its processes (API server, EngineCore, workers), which registers the KV connector
name ``DLMixConnector`` with vLLM's ``KVConnectorFactory``. Then::

    --kv-transfer-config '{"kv_connector": "DLMixConnector", "kv_role": "kv_producer"}'

(or ``kv_consumer`` / ``kv_both``) selects it; settings go in ``kv_connector_extra_config``
(see :class:`dlmix_vllm.config.DLMixSettings`). This module imports nothing heavy: the connector module is imported
lazily by vLLM when the connector is first used.
"""
from __future__ import annotations

CONNECTOR_NAME = "DLMixConnector"
CONNECTOR_MODULE = "dlmix_vllm.connector"

__all__ = ["CONNECTOR_NAME", "CONNECTOR_MODULE", "register"]


def register() -> bool:
    """Register ``DLMixConnector`` with vLLM's ``KVConnectorFactory`` (idempotent per process).

    Returns True when this call registered it, False when it was already registered (vLLM's registry raises
    ValueError on a duplicate name, so the name is checked first and a concurrent duplicate is swallowed).
    Raises ImportError only if vLLM itself cannot be imported.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, "DLMixConnector")
    except ValueError:
        return False
    return True
