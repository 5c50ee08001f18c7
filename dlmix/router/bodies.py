"""Type checks of the known fields of client generation bodies (OpenAI ``/v1/completions`` and
``/v1/chat/completions``), so a malformed body gets a ``400`` naming the field instead of a router error.

Only the fields the router reads or that engines reject by type are typed (the OpenAI API reference and vLLM's
``CompletionRequest``/``ChatCompletionRequest`` in ``vllm/entrypoints/openai/protocol.py``); every other field passes
through unchecked, and engines keep their own validation (ranges, sampling rules). Bodies the router does not parse
(one model and a policy that needs no prompt) reach the engine as they are; the engine then answers 400 itself.
"""
from __future__ import annotations

from typing import Annotated, Any, Dict, Iterable, List, Optional, Union

import msgspec

__all__ = ["BadRequest", "EMPTY_BODY", "check", "decode", "add_keys", "one_token_leg", "n_choices", "RouterFields"]


class BadRequest(ValueError):
    """A client body the router refuses (400); the message names the problem."""


#: a token id of a token-id prompt: what the router's block hashes can encode (engines check the vocabulary)
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class _Part(msgspec.Struct):
    type: str
    text: Optional[str] = None


class _Message(msgspec.Struct):
    role: str
    content: Union[str, List[_Part], None] = None


class _Common(msgspec.Struct):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[Dict[str, Any]] = None
    n: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Union[str, List[str], None] = None
    seed: Optional[int] = None
    cache_salt: Optional[str] = None
    min_tokens: Optional[int] = None
    kv_transfer_params: Optional[Dict[str, Any]] = None


class _Completion(_Common, kw_only=True):
    prompt: Union[str, List[Union[str, _TokenId, List[_TokenId]]]]


class _Chat(_Common, kw_only=True):
    messages: List[_Message]
    max_completion_tokens: Optional[int] = None


_conv = msgspec.convert


def check(d: Any, chat: bool) -> None:
    """Check the known fields of a decoded body ``d`` (``chat``: a chat completion, else a completion).

    Raises BadRequest with the field's JSON path, e.g. ``Expected `str | null`, got `int` - at
    `$.messages[0].content[0].text```; ``messages``/``prompt`` are required; ``n`` must be at least 1.
    """
    if not isinstance(d, dict):
        raise BadRequest("request body must be a JSON object")
    try:
        v = _conv(d, _Chat if chat else _Completion)
    except msgspec.ValidationError as ex:
        raise BadRequest(f"invalid request body: {ex}") from None
    if v.n is not None and v.n < 1:
        raise BadRequest(f"invalid request body: n must be at least 1, got {v.n}")
    if chat and not v.messages:
        raise BadRequest("invalid request body: messages must not be empty")
    if not chat and _empty_prompt(v.prompt):
        # every engine refuses it, and LMDeploy 0.18's engine loop dies on it (``assert len(token_ids) > 0`` in
        # ``pytorch/engine/engine.py`` ``_add_message``): the instance then serves nothing until restarted
        raise BadRequest("invalid request body: prompt must not be empty")


def _empty_prompt(p: Any) -> bool:
    """True for an empty completion prompt: ``""``, ``[]``, or a batch with an empty element (``[""]``, ``[[]]``)."""
    if isinstance(p, str) or not p:
        return not p
    if all(isinstance(x, int) for x in p):
        return False
    return any(not x for x in p)


EMPTY_BODY = "request body is empty; expected a JSON object"


def decode(body: bytes) -> Any:
    """JSON-decode a client body. Raises BadRequest for an empty body, invalid JSON, invalid UTF-8 or nesting too
    deep."""
    if not body or body.isspace():
        raise BadRequest(EMPTY_BODY)
    try:
        return msgspec.json.decode(body)
    except msgspec.DecodeError as ex:
        raise BadRequest(f"request body is not valid JSON: {ex}") from None
    except RecursionError:
        raise BadRequest("request body is not valid JSON: nested too deeply") from None


_enc_keys = msgspec.json.Encoder()


def add_keys(raw: bytes, extra: Dict[str, Any], parsed: Optional[dict] = None) -> bytes:
    """The JSON object ``raw`` with the top-level keys of ``extra`` added after its own (engine hand-offs such as
    ``kv_transfer_params`` or SGLang's bootstrap fields). The bytes are spliced, not re-encoded, unless ``raw``
    already names one of the keys: then ``parsed`` (or a fresh decode of ``raw``) is re-encoded with them replaced.
    Raises ValueError if ``raw`` is not a JSON object."""
    if any(b'"%s"' % k.encode() in raw for k in extra):
        d = dict(parsed) if parsed is not None else msgspec.json.decode(raw)
        if not isinstance(d, dict):
            raise ValueError("request body is not a JSON object")
        d.update(extra)
        return _enc_keys.encode(d)
    s = raw.rstrip()
    if not s.endswith(b"}"):
        raise ValueError("request body is not a JSON object")
    head = s[:-1].rstrip()
    sep = b"" if head.endswith(b"{") else b","
    return head + sep + _enc_keys.encode(extra)[1:]


class RouterFields:
    """Top-level body fields only the router may set: the PD hand-off fields of every engine adapter (vLLM's
    ``kv_transfer_params``, SGLang's ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``, LMDeploy's
    ``migration_request``/``with_cache``/``preserve_cache``; each adapter's ``HANDOFF_FIELDS``).

    A client that sets one could point an instance at a KV producer of its choosing (a decode then connects there and
    waits on it), make a prefill keep a request's KV blocks after the answer (LMDeploy's ``preserve_cache``), or
    join another request's hand-off, so the router refuses such a body (400) instead of forwarding it. ``null`` and
    ``false`` (what the engines default to) pass.

    Args: names: the field names (str).
    """

    def __init__(self, names: Iterable[str]):
        self.names = tuple(sorted(set(names)))
        # decodes only these top-level keys (escaped spellings included); msgspec skips every other value in C
        self._dec = msgspec.json.Decoder(msgspec.defstruct("_RouterFields", [(n, Any, None) for n in self.names]))

    def check_raw(self, raw: bytes) -> None:
        """:meth:`check` on a raw JSON body the router does not otherwise parse (about 0.5 us for a 1 KB body).
        A body that is not a JSON object passes: the engine refuses it itself. Raises BadRequest."""
        try:
            v = self._dec.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            return
        self._refuse_set(getattr(v, k) for k in self.names)

    def check(self, d: Any) -> None:
        """Raise BadRequest naming the first field of the decoded body ``d`` (a dict; anything else passes) that is
        set to a value other than ``null``/``false``."""
        if isinstance(d, dict):
            self._refuse_set(d.get(k) for k in self.names)

    def _refuse_set(self, values: Iterable[Any]) -> None:
        """Raise BadRequest naming the first of :attr:`names` whose value (``values``, in that order) is set."""
        for k, v in zip(self.names, values):
            if v is not None and v is not False:
                raise BadRequest(f"invalid request body: `{k}` is set by the router for prefill/decode hand-offs; "
                                 "a client may not send it")


def n_choices(body: Any) -> int:
    """The choices a parsed client ``body`` asks for: its ``n`` when that is an integer above 1, else 1 (a
    malformed ``n`` is left for the engine to refuse with its own 400)."""
    n = body.get("n") if isinstance(body, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def one_token_leg(body: dict, chat: bool) -> dict:
    """A copy of the client's parsed ``body`` as a sequential PD flow's prefill leg: one output token
    (``max_tokens=1``, and ``max_completion_tokens=1`` for chat), one choice (``n=1`` for a request of ``n > 1``
    choices: the prompt is prefilled once and the decode fans out), not streamed, no ``stream_options``. The engine
    adapter adds its own fields. ``body`` is not modified."""
    b = dict(body)
    if n_choices(b) > 1:
        b["n"] = 1
    b["max_tokens"] = 1
    if chat:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    return b
