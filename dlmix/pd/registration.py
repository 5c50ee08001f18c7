"""The one builder of the router registration body (``POST /admin/instances``, see :mod:`dlmix.router.server`),
used by every engine adapter (the vLLM connector's router client, ``dlmix launch``'s static instance list, the next
engines' adapters), and its validating decoder (for the router to check a body against the same schema).

Body fields (JSON): ``id``, ``url`` (``http://host:port``, required), ``role`` (``prefill``/``decode``/``both``),
``engine`` (``vllm``, ``sglang``, ``lmdeploy``, ...), ``model`` (served name, or a list), ``chip`` (catalog name),
``num_chips``, ``cluster``, ``block_size`` (tokens), ``kv_layout`` (``KVLayout.to_dict()``), ``transport`` (TP rank
0's transport descriptor, or a link description such as ``{"link": "rdma-100g"}``), ``kv_events``
(``tcp://host:port`` of the engine's ZMQ KV-event publisher), ``heartbeat_ttl_s`` (0 = no heartbeats expected),
``contract_version`` (the PD contract the instance speaks, :data:`dlmix.pd.contract.CONTRACT_VERSION`), ``api_key``
(bearer key the router presents to the instance), ``lora_adapters`` (``{name: path}`` of the LoRA adapters the
instance serves, as vLLM's ``--lora-modules``; the router puts vLLM's ``("lora", name, path)`` key into the prefix
hashes of requests naming one), ``bootstrap_port`` (the port of the instance's PD bootstrap server, on the host of
``url``: SGLang's ``--disaggregation-bootstrap-port``; required for a prefill instance of an engine whose PD flow
is concurrent, see :mod:`dlmix.router.engines.base`).
Unset optional fields are omitted (the router applies its defaults).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import msgspec

from dlmix.kv.layout import MAX_DIM, KVLayout

from .contract import CONTRACT_VERSION, ContractError

__all__ = ["Registration", "registration_body", "decode_registration", "advertised_endpoint", "ROLES"]

ROLES = ("prefill", "decode", "both")


#: the longest heartbeat TTL a registration may ask for (seconds; etcd's ``MaxLeaseTTL``)
MAX_HEARTBEAT_TTL_S = 9_000_000_000.0

class Registration(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=False):
    """Typed registration body (see module doc). Unknown keys are tolerated on decode (the router keeps them as
    ``extra``); known keys are type-checked."""

    url: str
    id: str | None = None
    role: Literal["prefill", "decode", "both"] = "both"
    engine: Annotated[str, msgspec.Meta(min_length=1)] = "vllm"
    model: str | list[str] | None = None
    chip: str | None = None
    num_chips: Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)] | None = None
    cluster: str | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_DIM)] | None = None
    kv_layout: dict[str, Any] | None = None
    transport: dict[str, Any] | None = None
    kv_events: str | None = None
    #: at most etcd's longest lease (``MaxLeaseTTL``, 9e9 s): a router replica grants a lease of this TTL, and a
    #: larger one (1e308) was refused by etcd *after* the registration was written (503, yet registered everywhere)
    heartbeat_ttl_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_HEARTBEAT_TTL_S)] | None = None
    contract_version: int | None = None
    api_key: str | None = None
    lora_adapters: dict[str, str] | None = None
    bootstrap_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None

    def __post_init__(self) -> None:
        u = urlparse(self.url.rstrip("/"))
        try:
            port = u.port
        except ValueError as e:  # e.g. "Port out of range 0-65535"
            raise ValueError(f"url {self.url!r}: {e}") from None
        if u.scheme not in ("http", "https") or not u.hostname or not port:
            raise ValueError(f"url must be http://host:port, got {self.url!r}")
        if self.kv_layout is not None:
            try:
                lay = KVLayout.from_dict(self.kv_layout)
            except (ValueError, TypeError) as e:
                raise ValueError(f"kv_layout is not a valid KV layout: {e}") from None
            if self.block_size is not None and self.block_size != lay.block_size:
                raise ValueError(f"block_size {self.block_size} differs from kv_layout.block_size {lay.block_size}")
        if self.contract_version is not None and self.contract_version != CONTRACT_VERSION:
            raise ValueError(f"unsupported contract version {self.contract_version} (router speaks "
                             f"{CONTRACT_VERSION})")


def registration_body(*, url: str, role: str = "both", engine: str = "vllm", instance_id: str | None = None,
                      model: str | list[str] | None = None, chip: str | None = None, num_chips: int | None = None,
                      cluster: str | None = None, block_size: int | None = None,
                      kv_layout: KVLayout | dict[str, Any] | None = None, transport: dict[str, Any] | None = None,
                      kv_events: str | None = None, heartbeat_ttl_s: float | None = None,
                      pd: bool | None = None, bootstrap_port: int | None = None) -> dict[str, Any]:
    """The JSON body of ``POST /admin/instances`` (pure function).

    ``block_size`` defaults to the layout's. ``pd``: whether the instance takes part in PD transfers under this
    contract (adds ``contract_version``); default: when a ``kv_layout`` is given.
    Raises ContractError with the reason on bad input (bad url/role, malformed layout, block size mismatch).
    """
    lay = kv_layout.to_dict() if isinstance(kv_layout, KVLayout) else (dict(kv_layout) if kv_layout else None)
    if block_size is None and lay is not None and isinstance(lay.get("block_size"), int):
        block_size = lay["block_size"]
    d: dict[str, Any] = {"url": str(url).rstrip("/"), "id": instance_id, "role": role, "engine": engine,
                         "model": model, "chip": chip, "num_chips": num_chips, "cluster": cluster,
                         "block_size": int(block_size) if block_size is not None else None, "kv_layout": lay,
                         "transport": dict(transport) if transport else None, "kv_events": kv_events,
                         "heartbeat_ttl_s": float(heartbeat_ttl_s) if heartbeat_ttl_s is not None else None,
                         "contract_version": CONTRACT_VERSION if (pd if pd is not None else lay is not None)
                         else None, "bootstrap_port": bootstrap_port}
    reg = decode_registration({k: v for k, v in d.items() if v is not None})
    out = msgspec.to_builtins(reg)
    if "role" not in out:  # omit_defaults drops it; the router's default is the same, but be explicit
        out["role"] = reg.role
    if "engine" not in out:
        out["engine"] = reg.engine
    return out


def advertised_endpoint(endpoint: str, host: str) -> str:
    """A bind endpoint (e.g. the engine's KV-event publisher ``tcp://*:5557``) as others reach it: a wildcard host
    (``*``, ``0.0.0.0``) replaced by ``host``. Pure function."""
    return endpoint.replace("*", host).replace("0.0.0.0", host)


def decode_registration(obj: Any) -> Registration:
    """Validate a registration body. Raises ContractError with a readable reason (never KeyError)."""
    if not isinstance(obj, dict):
        raise ContractError(f"registration body must be an object, got {type(obj).__name__}")
    try:
        return msgspec.convert(obj, Registration, strict=True)
    except msgspec.ValidationError as e:
        raise ContractError(f"invalid registration: {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise ContractError(f"invalid registration: {e}") from None
