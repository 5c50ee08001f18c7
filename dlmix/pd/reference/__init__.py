"""A reference PD producer written against the dlmix PD core alone (no engine).

``python -m dlmix.pd.reference --model DIR --port 8100`` starts a small HTTP process that answers the router's
prefill leg: transformers' forward pass fills a paged KV cache in a layout unlike vLLM CPU's, the blocks are held
through the core's producer side, and a decode instance (e.g. vLLM with ``DLMixConnector`` as ``kv_consumer``) pulls
them with the contract's transfer parameters. It exists to prove that the core is engine-neutral and as the
example to copy when adding an engine (docs/adding-an-engine.md). Needs ``dlmix[model]`` (torch, transformers),
imported lazily: importing this package imports neither.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ReferenceConfig", "ReferenceProducer", "ReferenceHTTPServer", "serve"]


def __getattr__(name: str) -> Any:
    if name in ("ReferenceConfig", "ReferenceProducer"):
        from . import producer

        return getattr(producer, name)
    if name == "ReferenceHTTPServer":
        from .server import ReferenceHTTPServer

        return ReferenceHTTPServer
    if name == "serve":
        from .__main__ import serve

        return serve
    raise AttributeError(f"module 'dlmix.pd.reference' has no attribute {name!r}")
