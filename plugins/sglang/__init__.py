"""dlmix adapter for SGLang (import name ``dlmix_sglang``; directory ``plugins/sglang``).

Installing dlmix next to SGLang is enough: SGLang runs the ``sglang.srt.plugins`` entry point ``dlmix =
"dlmix_sglang:register"`` in each of its processes (``sglang.srt.plugins.load_plugins``), and :func:`register` adds
the KV transfer backend ``dlmix``. Then::

    python -m sglang.launch_server ... --disaggregation-mode prefill --disaggregation-transfer-backend dlmix
    python -m sglang.launch_server ... --disaggregation-mode decode  --disaggregation-transfer-backend dlmix

runs SGLang's own prefill/decode disaggregation (bootstrap server, rooms, queues, polling) with the transfer done by
the engine-neutral PD core (:mod:`dlmix.pd`): decode pulls the prefill's pages and converts page size, KV dtype and
arrangement on the way (:mod:`dlmix_sglang.conn`). Settings: :mod:`dlmix_sglang.config`. Nothing changes when another
backend is selected. With ``router_url`` in the settings, the scheduler also registers the instance with the dlmix
router and heartbeats its load (:mod:`dlmix_sglang.router_hook`, a ``HookRegistry`` hook installed only then). This
module imports nothing heavy; SGLang imports the backend classes when it first asks for them.
"""
from __future__ import annotations

import logging
import os

BACKEND_NAME = "dlmix"

__all__ = ["BACKEND_NAME", "register"]

log = logging.getLogger("dlmix_sglang")


def _add_enum_member() -> None:
    """Add ``TransferBackend.DLMIX = "dlmix"`` to SGLang's closed ``TransferBackend`` enum (idempotent).

    SGLang builds ``TransferBackend(server_args.disaggregation_transfer_backend)`` in the scheduler, the tokenizer
    mixin and the disaggregation service, and has no public way to extend the enum: the member is created and entered
    in the enum's value map, member map and name list (the only private step of this adapter).
    """
    from sglang.srt.disaggregation.utils import TransferBackend

    if BACKEND_NAME in TransferBackend._value2member_map_:
        return
    member = object.__new__(TransferBackend)
    member._name_ = "DLMIX"
    member._value_ = BACKEND_NAME
    if hasattr(TransferBackend, "_sort_order_"):
        member._sort_order_ = len(TransferBackend._member_names_)
    type.__setattr__(TransferBackend, "DLMIX", member)
    TransferBackend._member_map_["DLMIX"] = member
    TransferBackend._value2member_map_[BACKEND_NAME] = member
    TransferBackend._member_names_.append("DLMIX")


def _get_kv_class(original, transfer_backend, class_type):
    """AROUND hook of ``sglang.srt.disaggregation.utils.get_kv_class``: dlmix's classes for the ``dlmix`` backend,
    SGLang's own for every other backend."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    if class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)
    from . import conn

    return {
        KVClassType.MANAGER: conn.DLMixKVManager,
        KVClassType.SENDER: conn.DLMixKVSender,
        KVClassType.RECEIVER: conn.DLMixKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.DLMixKVBootstrapServer,
    }[class_type]


#: SGLang's per-request check in its tokenizer manager (length against the context); it does not look at the ids
VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"


def _refuse_out_of_vocab(manager, obj, input_ids, *args, **kwargs):
    """BEFORE hook of ``TokenizerManager._validate_one_request`` (installed whatever the transfer backend): a prompt
    given as token ids with an id outside ``[0, vocab_size)`` is refused with a ``ValueError`` naming the id, which
    SGLang answers as a 400. SGLang 0.5.23 checks only ``token_ids_logprob`` against the vocabulary, so such a
    prompt reached the embedding lookup, whose ``IndexError`` ended the scheduler and the whole server (every
    request in flight failed). Returns None (the arguments are unchanged).

    Raises:
      ValueError: the first out-of-range id, its position and the valid range.
    """
    vocab = getattr(getattr(manager, "model_config", None), "vocab_size", None)
    if not input_ids or not isinstance(vocab, int) or vocab <= 0:
        return None
    for i, t in enumerate(input_ids):
        if not 0 <= t < vocab:
            raise ValueError(f"prompt token id {t} at position {i} is out of the model's vocabulary; valid range "
                             f"is [0, {vocab})")
    return None


_registered = False


def _router_url_set() -> bool:
    """Whether ``DLMIX_SGLANG_CONFIG`` names a dlmix router (the scheduler hook is installed only then). Raises
    :class:`dlmix_sglang.config.DLMixSGLangConfigError` for an invalid configuration."""
    from .config import load_settings

    return bool(os.environ.get("DLMIX_SGLANG_CONFIG")) and load_settings().router_url is not None


def register() -> bool:
    """SGLang plugin entry point (group ``sglang.srt.plugins``): accept ``--disaggregation-transfer-backend dlmix``
    and serve its classes. Idempotent per process; returns True when this call registered. Raises ImportError only
    when SGLang itself cannot be imported."""
    global _registered
    if _registered:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_disagg_transfer_backend_choices

    try:
        from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES

        known = list(DISAGG_TRANSFER_BACKEND_CHOICES)
    except ImportError:
        known = []
    if BACKEND_NAME not in known:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    _add_enum_member()
    HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", _get_kv_class, HookType.AROUND)
    HookRegistry.register(VALIDATE_TARGET, _refuse_out_of_vocab, HookType.BEFORE)
    if _router_url_set():
        from . import router_hook

        HookRegistry.register(router_hook.TARGET, router_hook.after_scheduler_init, HookType.AFTER)
    if os.environ.get("DLMIX_SGLANG_CPU_AIDS") == "1":
        _cpu_aids()
    _registered = True
    return True


def _cpu_aids() -> None:
    """Opt-in development aids for SGLang on a CPU-only host (``DLMIX_SGLANG_CPU_AIDS=1``; the test aid
    :func:`dlmix_sglang.testing.start_server` sets it, and ``benchmarks/pd_sglang.py`` for its baseline):

    * SGLang's Mooncake sender claims host tensor indices, whose pinned-memory/CUDA-event path fails on a CPU-only
      host (``prefill.py`` ``_send_kv_chunk``); that claim is turned off so Mooncake over TCP runs on CPU;
    * an unquantized linear layer's 16-bit product of many rows runs in fp32 where the CPU has no native kernel for
      its dtype (an AROUND hook on ``UnquantizedLinearMethod.apply``; :mod:`dlmix.testing.cpu_gemm`): on an
      AVX2-only CPU a bf16 prefill otherwise runs several times slower. Layers on SGLang's AMX path keep it.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply",
                          _linear_in_fp32_where_slow, HookType.AROUND)
    try:
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    except ImportError as e:
        log.info("dlmix_sglang CPU aids: Mooncake backend not importable (%s)", e)
        return
    MooncakeKVSender.supports_host_tensor_indices = False


def _linear_in_fp32_where_slow(original, method, layer, x, bias=None):
    """AROUND hook of ``UnquantizedLinearMethod.apply`` (CPU aid): :func:`dlmix.testing.cpu_gemm.linear_fp32` when
    :func:`~dlmix.testing.cpu_gemm.wants_fp32` and the layer is not on SGLang's AMX path, else SGLang's own."""
    from dlmix.testing.cpu_gemm import linear_fp32, wants_fp32

    if wants_fp32(x) and not getattr(layer, "use_intel_amx_backend", False):
        return linear_fp32(x, layer.weight, bias)
    return original(method, layer, x, bias)
