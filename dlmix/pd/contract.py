"""The PD transfer contract: what a prefill (producer) hands to a decode (consumer), and every control message
between the two sides. Typed (msgspec Structs), versioned, validated on receipt. Engine-neutral and torch-free.

Two directions, one decode function each:

* **Transfer parameters** (:class:`TransferParams`), producer -> consumer, carried by the engine's request plumbing
  (vLLM: the ``kv_transfer_params`` of the prefill response, passed by the router into the decode request). Wire names
  follow vLLM's disaggregated-serving convention (``remote_*``, as in vLLM's ``nixl_connector.py``) so the same dict is
  a valid vLLM ``kv_transfer_params``. Decode with :func:`decode_params`.
* **Control messages** (:data:`ControlMessage`), both directions, small dicts on the transport's authenticated
  control channel (``dlmix_kv_connectors`` ``notify``), tagged by ``"type"``:

  ====================  ==================  ==========================================================================
  tag                   direction           meaning
  ====================  ==================  ==========================================================================
  ``want``              consumer->producer  grant me read access to these held blocks (sends the consumer's layout)
  ``blocks_ready``      producer->consumer  granted; read now
  ``refused``           producer->consumer  not granted, with the reasons
  ``extend``            consumer->producer  a long read is progressing: keep the hold (and grant) alive
  ``blocks_consumed``   consumer->producer  done reading: release the hold
  ``abort``             consumer->producer  not reading (refused, failed or aborted): release the hold
  ====================  ==================  ==========================================================================

  Decode with :func:`decode_message`.

Versioning: :data:`CONTRACT_VERSION` (an integer, bumped on any incompatible change). Parameters must state it
(``contract_version``); a control message may omit ``v`` (then it is the current version). Any other version is
refused with a :class:`ContractError` naming both versions.

Prompt identity (:func:`prompt_digest`): ``"sha256:" + hex(sha256(b))`` where ``b`` is the prompt token ids encoded as
consecutive little-endian signed 32-bit integers (4 bytes per token, no header, no separator). Engines apply chat
templates and BOS rules differently; a consumer compares the producer's digest with its own prompt's and refuses
a mismatch instead of decoding from someone else's KV.
"""
from __future__ import annotations

import hashlib
import re
import sys
from array import array
from typing import Annotated, Any, Iterable, Literal, Union

import msgspec

from dlmix.kv.layout import KVLayout

__all__ = [
    "CONTRACT_VERSION",
    "TRANSFER_MODE",
    "ContractError",
    "TransportDescriptor",
    "TransferParams",
    "Want",
    "Ready",
    "Refuse",
    "Extend",
    "Consumed",
    "Abort",
    "ControlMessage",
    "prompt_digest",
    "block_ids_transfer_id",
    "block_ids_session_alias",
    "decode_params",
    "decode_message",
    "encode",
    "ENVELOPE_KEYS",
    "MAX_CONSUMERS",
    "RoomHandoffRequest",
    "RoomHandoff",
    "decode_room_handoff",
]

#: Version of this contract. Both sides must speak the same one.
CONTRACT_VERSION = 1

#: ``transfer_mode`` of parameters produced under this contract (the consumer pulls granted blocks).
TRANSFER_MODE = "dlmix-pull"

#: Keys of vLLM's ``kv_transfer_params`` envelope that are not part of the contract and are ignored by
#: :func:`decode_params`: vLLM's own flags, ``remote_prefill_cached_tokens`` (added by vLLM's scheduler to the
#: params a producer returns, ``vllm/v1/core/sched/scheduler.py``), and the consumer's private marker.
ENVELOPE_KEYS = frozenset({"do_remote_prefill", "do_remote_decode", "remote_prefill_cached_tokens",
                           "_dlmix_consumer", "dlmix_consumers"})

#: most consumers one hold may wait for (vLLM caps ``n`` far lower in practice; a bound keeps a bad value harmless)
MAX_CONSUMERS = 256

_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
_INT32_MIN, _INT32_MAX = -(2 ** 31), 2 ** 31 - 1

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Ident = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
#: TP ranks of one instance (the bound of :class:`TransferParams` ``transports``)
Ranks = Annotated[int, msgspec.Meta(ge=1, le=1024)]
Consumers = Annotated[int, msgspec.Meta(ge=1, le=MAX_CONSUMERS)]


class ContractError(ValueError):
    """A message or parameter set that does not satisfy the contract. ``reason`` is one readable sentence (also
    the exception text); it never leaks a KeyError/TypeError from the decoder."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def prompt_digest(token_ids: Iterable[int]) -> str:
    """Digest of a prompt's token ids: ``"sha256:<64 hex>"`` of the ids as little-endian int32 (see module doc).

    Args: token_ids: the prompt token ids in order (any iterable of ints, e.g. a list or vLLM's ``prompt_token_ids``).
    Raises ContractError when an id is not an integer in the int32 range.
    """
    try:
        ids = list(token_ids)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__"):
                raise TypeError(f"token id {t!r} is not an integer")
        a = array("i", (int(t) for t in ids))
    except OverflowError:
        raise ContractError("a token id is outside the int32 range") from None
    except TypeError as e:
        raise ContractError(f"prompt token ids must be integers: {e}") from None
    if a.itemsize != 4:  # pragma: no cover - every CPython platform we run on has a 4-byte C int
        raise ContractError("this platform's C int is not 32 bits")
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return "sha256:" + hashlib.sha256(a.tobytes()).hexdigest()


def block_ids_transfer_id(block_ids: Iterable[int]) -> str:
    """Transfer id of a hold named by its producer block ids: ``"blk-<count>-<24 hex>"``, the count of blocks and the
    BLAKE2b (12-byte digest) of the ids written in decimal, comma-separated, in token order.

    For producers whose request id is not visible outside the engine (LMDeploy 0.18 answers the user's
    ``session_id``, or ``-1``, not the engine's session): both the producer and whoever builds the consumer's
    :class:`TransferParams` (the router) know the block ids, and blocks held for one request are not reused while
    held, so the ids name the hold. Raises ContractError when an id is not a non-negative integer.
    """
    try:
        ids = [int(b) for b in block_ids]
    except (TypeError, ValueError) as e:
        raise ContractError(f"block ids must be integers: {e}") from None
    if any(b < 0 for b in ids):
        raise ContractError("block ids must be non-negative")
    h = hashlib.blake2b(",".join(str(b) for b in ids).encode(), digest_size=12)
    return f"blk-{len(ids)}-{h.hexdigest()}"


def block_ids_session_alias(block_ids: Iterable[int]) -> int:
    """A negative integer naming the same hold as :func:`block_ids_transfer_id` (``-2`` minus its first 48 bits),
    for engine APIs whose free or abort carries only an integer session id (LMDeploy's ``/distserve/free_cache``
    ``remote_session_id``). Engines number their own sessions from 0 and use ``-1`` for "none", so an alias never
    names a real session. Raises ContractError like :func:`block_ids_transfer_id`."""
    return -2 - int(block_ids_transfer_id(block_ids).rsplit("-", 1)[1][:12], 16)


class TransportDescriptor(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """How a consumer reaches one producer worker (one per TP rank): what ``dlmix_kv_connectors`` ``connect()``
    takes. ``kind``: transport kind (``tcp``, ``shm``, ``mooncake``, ``nixl``, ``dlslime``); ``name``: the worker's
    transport peer id; ``host``/``port``: its control endpoint; ``auth``: the authentication scheme handle
    (``hmac-shared-secret``: both sides configured with the same secret; the secret itself never travels).
    Transport-specific keys (``proto``, ``pid``, ``host_id``, ``regions``, ...) are kept as given in the dict form
    (see :meth:`from_transport`/:meth:`to_transport`)."""

    kind: Ident
    name: Ident
    host: Ident = "127.0.0.1"
    port: Port = 0
    auth: Literal["hmac-shared-secret"] = "hmac-shared-secret"

    @staticmethod
    def check(d: Any) -> dict[str, Any]:
        """Validate a transport descriptor dict (as produced by a transport's ``descriptor()``) and return it
        unchanged (all keys kept). Raises ContractError with the reason."""
        if not isinstance(d, dict):
            raise ContractError(f"transport descriptor must be an object, got {type(d).__name__}")
        try:
            msgspec.convert(d, TransportDescriptor, strict=True)
        except msgspec.ValidationError as e:
            raise ContractError(f"transport descriptor: {e}") from None
        return d


def _check_layout(d: Any, what: str) -> KVLayout:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a KV layout object, got {type(d).__name__}")
    try:
        return KVLayout.from_dict(d)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} is not a valid KV layout: {e}") from None


def _check_digest(d: str | None) -> None:
    if d is not None and not _DIGEST_RE.fullmatch(d):
        raise ValueError("prompt digest must be 'sha256:' followed by 64 lowercase hex digits")


class TransferParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, rename={
    "version": "contract_version", "engine": "remote_engine", "instance_id": "remote_engine_id",
    "transports": "remote_transports", "request_id": "remote_request_id", "block_ids": "remote_block_ids",
    "num_tokens": "remote_num_tokens", "digest": "remote_prompt_digest", "layout": "remote_layout",
    "expiry_s": "remote_expiry_s"}):
    """Parameters a producer hands to a consumer for one request (wire names in brackets).

    Fields:
      version [``contract_version``]: :data:`CONTRACT_VERSION`.
      engine [``remote_engine``]: producer engine name (``vllm``, ``sglang``, ``lmdeploy``, ``reference``, ...).
      instance_id [``remote_engine_id``]: producer instance id (vLLM's ``engine_id``).
      transports [``remote_transports``]: one transport descriptor dict per producer TP rank, rank order
        (checked with :meth:`TransportDescriptor.check`; the consumer's rank ``r`` reads from entry ``r``).
      request_id [``remote_request_id``]: the producer's request id; also the transfer id of the grant.
      block_ids [``remote_block_ids``]: the producer blocks holding the prompt's KV, in token order.
      num_tokens [``remote_num_tokens``]: tokens whose KV the blocks hold (``<= len(block_ids) * block_size``).
      digest [``remote_prompt_digest``]: :func:`prompt_digest` of those tokens' ids, or None when the producer
        cannot see token ids (then prompt identity is not checked).
      layout [``remote_layout``]: the producer's KV layout (``KVLayout.to_dict()``, TP rank 0; rank ``r`` is
        ``with_rank(r)``). It travels once, here; the consumer never asks for it again.
      expiry_s [``remote_expiry_s``]: the producer frees the blocks this many seconds after the hold began unless
        a read is in progress.
      transfer_mode: :data:`TRANSFER_MODE`.

    Built by :meth:`make`; decoded (and validated) by :func:`decode_params`; :meth:`to_dict` gives the wire dict.
    """

    version: int
    engine: Ident
    instance_id: Ident
    transports: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=1024)]
    request_id: Ident
    block_ids: Annotated[list[NonNegInt], msgspec.Meta(max_length=1 << 22)]
    num_tokens: NonNegInt
    layout: dict[str, Any]
    digest: str | None = None
    expiry_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    transfer_mode: Literal["dlmix-pull"] = TRANSFER_MODE

    def __post_init__(self) -> None:
        if self.version != CONTRACT_VERSION:
            raise ValueError(f"unsupported contract version {self.version!r} (this side speaks {CONTRACT_VERSION})")
        for i, t in enumerate(self.transports):
            try:
                TransportDescriptor.check(t)
            except ContractError as e:
                raise ValueError(f"remote_transports[{i}]: {e.reason}") from None
        lay = _check_layout(self.layout, "remote_layout")
        _check_digest(self.digest)
        need = -(-self.num_tokens // lay.block_size)
        if need > len(self.block_ids):
            raise ValueError(f"{self.num_tokens} tokens need {need} blocks of {lay.block_size}, "
                             f"remote_block_ids has {len(self.block_ids)}")

    @classmethod
    def make(cls, *, engine: str, instance_id: str, transports: list[dict[str, Any]], request_id: str,
             block_ids: list[int], num_tokens: int, layout: KVLayout | dict[str, Any],
             token_ids: Iterable[int] | None = None, digest: str | None = None,
             expiry_s: float = 0.0) -> "TransferParams":
        """Build validated parameters (``token_ids`` -> :func:`prompt_digest` unless ``digest`` is given).
        Raises ContractError with the reason on bad input."""
        if digest is None and token_ids is not None:
            digest = prompt_digest(token_ids)
        d = {"contract_version": CONTRACT_VERSION, "remote_engine": engine, "remote_engine_id": instance_id,
             "remote_transports": [dict(t) for t in transports], "remote_request_id": request_id,
             "remote_block_ids": [int(b) for b in block_ids], "remote_num_tokens": int(num_tokens),
             "remote_layout": layout.to_dict() if isinstance(layout, KVLayout) else layout,
             "remote_prompt_digest": digest, "remote_expiry_s": float(expiry_s)}
        return decode_params(d)

    @property
    def kv_layout(self) -> KVLayout:
        """The producer's layout as a :class:`KVLayout` (validated at decode time)."""
        return KVLayout.from_dict(self.layout)

    def transport_for_rank(self, tp_rank: int) -> dict[str, Any]:
        """Transport descriptor of producer rank ``tp_rank``. Raises ContractError when the producer has fewer."""
        if not 0 <= tp_rank < len(self.transports):
            raise ContractError(f"producer has {len(self.transports)} TP rank(s); no transport for rank {tp_rank}")
        return self.transports[tp_rank]

    def to_dict(self) -> dict[str, Any]:
        """The wire dict (JSON-able; vLLM ``kv_transfer_params`` keys)."""
        return msgspec.to_builtins(self)


# ---------------------------------------------------------------------------------------------------- control
class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    req: Ident
    v: int = CONTRACT_VERSION

    def __post_init__(self) -> None:
        if self.v != CONTRACT_VERSION:
            raise ValueError(f"unsupported contract version {self.v!r} (this side speaks {CONTRACT_VERSION})")


class Want(_Msg, tag="want"):
    """Consumer -> producer: grant read access to ``block_ids`` (must equal the held blocks) of transfer ``req``.
    ``layout``: the consumer's KVLayout dict (the producer's security gate checks the pair with it).
    ``digest``: the consumer's prompt digest (optional; the producer refuses a mismatch with its hold's digest).
    ``send_layout``: ask the producer to include its layout in :class:`Ready` (only for callers that have no
    :class:`TransferParams`; the engine path never sets it).
    ``ranks``: how many ranks of the consumer's decode instance will read or release this producer rank (its TP
    size when the two sides' TP sizes differ; 1 otherwise): each may be granted, and the hold waits for a
    ``blocks_consumed``/``abort`` from each.
    ``consumers``: pulls each of those ranks will make of the hold (the ``n`` of a request the decode fans out into
    ``n`` choices), for a producer that could not know it (a hold a router's bridge handed across engines: the
    router names ``n`` in the decode's parameters as ``dlmix_consumers``); the hold then waits for that many notices
    per rank (the larger of the producer's and this count, 1..:data:`MAX_CONSUMERS`)."""

    block_ids: Annotated[list[NonNegInt], msgspec.Meta(max_length=1 << 22)]
    layout: dict[str, Any]
    digest: str | None = None
    send_layout: bool = False
    ranks: Ranks = 1
    consumers: Consumers = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_layout(self.layout, "want.layout")
        _check_digest(self.digest)


class Ready(_Msg, tag="blocks_ready"):
    """Producer -> consumer: the grant for ``req`` is in place. ``layout``: the producer's layout, only when the
    Want asked for it (``send_layout``). ``tid``: the transfer id the grant was made under, when it is not ``req``
    (a second rank of the same decode instance reading this producer rank gets a grant of its own). ``pages``: the
    pages to read in this producer rank's regions, one per wanted block in the same order, when they are not the
    wanted block ids (a device cache staged through a host outbox: :mod:`dlmix.pd.outbox`)."""

    layout: dict[str, Any] | None = None
    tid: Annotated[str, msgspec.Meta(min_length=1, max_length=520)] | None = None
    pages: Annotated[list[NonNegInt], msgspec.Meta(max_length=1 << 22)] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout is not None:
            _check_layout(self.layout, "blocks_ready.layout")


class Refuse(_Msg, tag="refused"):
    """Producer -> consumer: no grant for ``req``; ``reasons`` says why (one sentence each)."""

    reasons: Annotated[list[Annotated[str, msgspec.Meta(max_length=4096)]], msgspec.Meta(min_length=1,
                                                                                         max_length=64)]


class Extend(_Msg, tag="extend"):
    """Consumer -> producer: a read of ``req`` is progressing; extend the hold and grant by the I/O timeout."""


class Consumed(_Msg, tag="blocks_consumed"):
    """Consumer -> producer: ``req``'s blocks were read; release the hold once each of the ``ranks`` consumer ranks
    (see :class:`Want`) has said so."""

    ranks: Ranks = 1


class Abort(_Msg, tag="abort"):
    """Consumer -> producer: ``req``'s blocks will not be read (refused, failed, aborted); release the hold once each
    of the ``ranks`` consumer ranks has released it."""

    ranks: Ranks = 1


#: Any control message.
ControlMessage = Union[Want, Ready, Refuse, Extend, Consumed, Abort]

_TAGS = {"want", "blocks_ready", "refused", "extend", "blocks_consumed", "abort"}


def _reason(e: msgspec.ValidationError) -> str:
    return str(e).replace("Object", "object")


def decode_params(obj: Any) -> TransferParams:
    """Validate a parameters dict (e.g. vLLM ``kv_transfer_params``; keys in :data:`ENVELOPE_KEYS` are ignored).

    Raises ContractError (never KeyError/TypeError) on: not an object, unknown or missing
    ``contract_version``, a missing field, an unknown field, a wrong type, a malformed layout or transport
    descriptor, a malformed digest, or fewer blocks than the tokens need.
    """
    if isinstance(obj, TransferParams):
        return obj
    if not isinstance(obj, dict):
        raise ContractError(f"transfer parameters must be an object, got {type(obj).__name__}")
    if "contract_version" not in obj:
        raise ContractError("transfer parameters have no contract_version (a producer of another contract, or "
                            "not dlmix parameters)")
    ver = obj["contract_version"]
    if ver != CONTRACT_VERSION or isinstance(ver, bool):
        raise ContractError(f"unsupported contract version {ver!r} (this side speaks {CONTRACT_VERSION})")
    body = {k: v for k, v in obj.items() if k not in ENVELOPE_KEYS}
    try:
        return msgspec.convert(body, TransferParams, strict=True)
    except msgspec.ValidationError as e:
        raise ContractError(f"invalid transfer parameters: {_reason(e)}") from None
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # defensive: never leak
        raise ContractError(f"invalid transfer parameters: {e}") from None


def decode_message(obj: Any) -> ControlMessage:
    """Validate one control message (a dict, or JSON bytes/str) into its Struct.

    Raises ContractError (never KeyError/TypeError) on: not an object, a missing or unknown ``type``, an unknown
    ``v``, a missing field, an unknown field or a wrong type.
    """
    if isinstance(obj, (bytes, bytearray, str)):
        try:
            obj = msgspec.json.decode(obj)
        except msgspec.DecodeError as e:
            raise ContractError(f"control message is not JSON: {e}") from None
    if isinstance(obj, _Msg):
        return obj  # type: ignore[return-value]
    if not isinstance(obj, dict):
        raise ContractError(f"control message must be an object, got {type(obj).__name__}")
    typ = obj.get("type")
    if not isinstance(typ, str) or typ not in _TAGS:
        raise ContractError(f"unknown control message type {typ!r}; known: {', '.join(sorted(_TAGS))}")
    v = obj.get("v", CONTRACT_VERSION)
    if v != CONTRACT_VERSION or isinstance(v, bool):
        raise ContractError(f"unsupported contract version {v!r} in {typ!r} (this side speaks {CONTRACT_VERSION})")
    try:
        return msgspec.convert(obj, ControlMessage, strict=True)
    except msgspec.ValidationError as e:
        raise ContractError(f"invalid {typ!r} message: {_reason(e)}") from None
    except (TypeError, ValueError, OverflowError, RecursionError) as e:  # defensive: never leak
        raise ContractError(f"invalid {typ!r} message: {e}") from None


def encode(msg: ControlMessage | TransferParams) -> dict[str, Any]:
    """JSON-able dict of a control message (with its ``type`` tag) or of parameters (wire names)."""
    return msgspec.to_builtins(msg)


# ---------------------------------------------------------------------------------------------------- room hand-off
class RoomHandoffRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A consumer of another engine asks a concurrent-flow prefill for the hand-off of bootstrap room ``room`` (a
    non-negative 63-bit integer), waiting at most ``timeout_s`` seconds for the prefill to compute the prompt.
    Answered with a :class:`RoomHandoff`."""

    room: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 600.0

class RoomHandoff(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a concurrent-flow prefill (SGLang: the producer learns of its consumer through a bootstrap *room*) answers
    a consumer of another engine that asks for a room's hand-off: the :class:`TransferParams` of the room's hold (one
    transport per producer TP rank) and the id of the first token the prefill generated (the decode of an engine
    that continues from the prefill's token needs it; None when the producer could not read it).

    Sent as JSON by the SGLang adapter's bootstrap route ``POST /dlmix/handoff`` (``plugins/sglang/handoff.py``);
    decoded by :func:`decode_room_handoff`.
    """

    params: dict[str, Any]
    first_token_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)] | None = None


def decode_room_handoff(raw: bytes) -> tuple[TransferParams, int | None]:
    """Validate a :class:`RoomHandoff` JSON answer. Returns ``(parameters, first token id or None)``. Raises
    ContractError with the reason (not JSON, a missing or unknown field, invalid parameters)."""
    try:
        h = msgspec.json.decode(raw, type=RoomHandoff)
    except msgspec.ValidationError as e:
        raise ContractError(f"invalid room hand-off: {_reason(e)}") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise ContractError(f"room hand-off is not JSON: {e}") from None
    return decode_params(h.params), h.first_token_id
