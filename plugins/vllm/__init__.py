"""dlmix adapter for vLLM (import name ``dlmix_vllm``; directory ``plugins/vllm``).

Installing dlmix next to vLLM is enough: vLLM runs the ``vllm.general_plugins`` entry point ``dlmix =
"dlmix_vllm:register"`` in each of its processes (API server, EngineCore, workers), which registers the KV connector
name ``DLMixConnector`` with vLLM's ``KVConnectorFactory``. Then::

    --kv-transfer-config '{"kv_connector": "DLMixConnector", "kv_role": "kv_producer"}'

(or ``kv_consumer`` / ``kv_both``) selects it; settings go in ``kv_connector_extra_config``
(see :class:`dlmix_vllm.config.DLMixSettings`). This module imports nothing heavy: the connector module is imported
lazily by vLLM when the connector is first used.

``DLMIX_VLLM_CPU_AIDS=1`` (off by default; ``dlmix launch`` sets it for vLLM instances on ``device: cpu``, the test
servers of :mod:`dlmix_vllm.testing` too) also installs :func:`cpu_aids`.
"""
from __future__ import annotations

import os

from dlmix.engine_process import VLLMServerSpec

CONNECTOR_NAME = "DLMixConnector"
CONNECTOR_MODULE = "dlmix_vllm.connector"

__all__ = ["CONNECTOR_NAME", "CONNECTOR_MODULE", "CPU_AIDS_ENV", "register", "cpu_aids"]

#: environment variable that turns :func:`cpu_aids` on (value ``1``) in every vLLM process (named by the core's
#: description of a vLLM server, which ``dlmix launch`` and the test servers build)
CPU_AIDS_ENV = VLLMServerSpec.CPU_AIDS_ENV


def register() -> bool:
    """Register ``DLMixConnector`` with vLLM's ``KVConnectorFactory`` (idempotent per process).

    Returns True when this call registered it, False when it was already registered (vLLM's registry raises
    ValueError on a duplicate name, so the name is checked first and a concurrent duplicate is swallowed).
    Raises ImportError only if vLLM itself cannot be imported.
    """
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if os.environ.get(CPU_AIDS_ENV) == "1":
        cpu_aids()
    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return False
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, "DLMixConnector")
    except ValueError:
        return False
    return True


def cpu_aids() -> bool:
    """A development aid for vLLM CPU on a host without a native 16-bit matrix product (``DLMIX_VLLM_CPU_AIDS=1``):
    an unquantized linear layer whose weight dtype is in :func:`dlmix.testing.cpu_gemm.slow_gemm_dtypes` computes
    its products of many rows (prefill chunks, :func:`~dlmix.testing.cpu_gemm.wants_fp32`) in fp32 and rounds the
    result to the layer's dtype once, and keeps vLLM's own kernel for a few rows (decode steps).

    Why: vLLM CPU 0.32 (``vllm/model_executor/layers/utils.py``, ``dispatch_cpu_unquantized_gemm``) packs a layer
    for oneDNN; on an AVX2-only x86 CPU oneDNN has no bf16 matmul ("could not create a primitive descriptor"), so
    vLLM falls back to ``torch.nn.functional.linear`` in bf16, torch's scalar path: measured there, one thread,
    ``[256, 576] @ [576, 1536]`` took 140 ms in bf16 against 20 ms in fp32. Both accumulate in fp32, so outputs
    differ only in summation order.

    How: wraps ``dispatch_cpu_unquantized_gemm`` (vLLM imports it from that module when it prepares each layer),
    which then keeps the layer's weight and sets ``layer.cpu_linear`` to choose per call. Idempotent per process;
    returns True when this call installed it. Raises ImportError only if vLLM cannot be imported."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "dlmix_cpu_aid", False):
        return False
    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight: bool) -> None:
        from dlmix.testing.cpu_gemm import linear_fp32, slow_gemm_dtypes, wants_fp32

        w = layer.weight
        if w.is_meta or w.ndim != 2 or w.dtype not in slow_gemm_dtypes():
            return original(layer, remove_weight)
        original(layer, remove_weight=False)
        native = layer.cpu_linear

        def cpu_linear(x, weight, bias):
            return linear_fp32(x, layer.weight, bias) if wants_fp32(x) else native(x, weight, bias)

        layer.cpu_linear = cpu_linear

    dispatch_cpu_unquantized_gemm.dlmix_cpu_aid = True
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return True
