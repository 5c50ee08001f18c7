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
import time

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
    returns True when this call installed it. Raises ImportError only if vLLM cannot be imported.

    Also :func:`_no_spin_waits`: vLLM's processes wait for each other's messages without spinning."""
    from vllm.model_executor.layers import utils

    _no_spin_waits()
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


#: how long a vLLM process waiting for another's next message sleeps between two looks at the queue
#: (:func:`_no_spin_waits`), seconds
WAIT_NAP_S = 0.0005


def _no_spin_waits() -> None:
    """The second CPU aid: a vLLM process waiting for the next message from another (a worker for the scheduler's
    next step, the EngineCore for the worker's output) sleeps between looks at the queue instead of spinning.

    Why: vLLM's shared-memory message queue (``SpinCondition`` in
    ``vllm/distributed/device_communicators/shm_broadcast.py``) has each reader spin on ``sched_yield`` for 1 s after
    every message it reads, so a worker holds its core between steps and for a second after each request. With
    several instances on a few cores that second is taken from the others: measured on a 2-core VM (Linux 6.18),
    a one-thread matrix loop pinned to a vLLM worker's core ran at 1% of its speed while that worker answered a
    short request every 0.5 s (56 against 4,841 products in 15 s). A GPU host has cores to spare and keeps the spin;
    on a CPU host every core is the engine's.

    How: wraps ``SpinCondition.wait`` so that within that busy second the reader sleeps :data:`WAIT_NAP_S` instead
    of yielding (a step waits at most that much longer for its message; a step on a CPU takes milliseconds). After
    the second, vLLM's own idle path is unchanged (a ``zmq`` poll on the writer's notification). Polling that
    notification after every message instead (a busy period of 0) lost wake-ups here: a decode's EngineCore and its
    worker each waited for the other's message, the decode advancing about one token a second. Idempotent per
    process."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = shm_broadcast.SpinCondition
    if getattr(cls.wait, "dlmix_cpu_aid", False):
        return
    spin_wait = cls.wait

    def wait(self, timeout_ms=None):
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(WAIT_NAP_S)
            return None
        return spin_wait(self, timeout_ms)

    wait.dlmix_cpu_aid = True
    wait.__wrapped__ = spin_wait
    cls.wait = wait
