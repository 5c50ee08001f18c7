"""Engine adapters: everything engine-specific the router needs, one small module per engine.

An adapter module exposes: ``HEALTH_PATH``, ``MODELS_PATH``, ``prefill_body(body: dict, chat: bool) -> dict``,
``decode_body(raw: bytes, kv_transfer_params: dict) -> bytes``, ``kv_transfer_params(resp_body: bytes) -> dict``.
"""
from dlmix.router.engines import vllm

ENGINES = {"vllm": vllm}


def get_engine(name: str):
    """Adapter module by engine name. Raises ValueError for an unknown engine."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; supported: {', '.join(ENGINES)}") from None
