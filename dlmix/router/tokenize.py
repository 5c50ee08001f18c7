"""Prompt extraction and tokenization as the engine does it, for prefix-aware placement.

Modes (router config ``tokenizer``):

* a Hugging Face tokenizer folder or hub id: loaded lazily with ``transformers.AutoTokenizer`` (fast tokenizer).
  Chat requests: ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` then
  ``encode(text, add_special_tokens=False)`` (vLLM's chat path: the template already carries BOS); completions:
  ``encode(prompt)`` with special tokens (vLLM default ``add_special_tokens=True``); a token-id list prompt is used as
  is. Results are cached by text (bounded). Exact block hashes → hits against engine KV events.
* ``bytes``: token ids = UTF-8 bytes of the text (test mode; the mock engines use the same rule).
* ``None`` (default): no tokenizer; the text is hashed in character chunks (4 chars ≈ 1 token, see
  :func:`dlmix.routing.hashing.char_chunk_keys`), which only feeds the approximate index. Cheap (a few µs per KB).

Speed: a byte-level BPE encode of 1 KB costs hundreds of µs. The HF mode therefore splits the text at the
tokenizer's added special tokens (``<|im_start|>`` …), which HF tokenizers also do before pre-tokenization, encodes each
piece separately and caches pieces by content (system prompts and shared documents repeat). The split is
self-checked: the first ``verify`` requests are also encoded whole; on any difference (e.g. SentencePiece
``prepend_scheme="first"``) the split is switched off and whole-text encoding (cached by text) is used.

Prefix keys (:func:`prefix_keys`): every key the router computes for a request carries the request's namespace as
the engine does: its ``cache_salt`` and, when its ``model`` names a LoRA adapter, the adapter (:func:`lora_of`), with
a tokenizer (vLLM's extra keys, exact) and without (the character-chunk chain starts from the namespace). Identical
prompts under different salts or adapters are therefore never prefix hits of each other.

Chat text without a tokenizer is ``"<|role|>\\n" + content + "\\n"`` per message (an approximation of a template;
stable per conversation prefix, which is all the approximate index needs).
"""
from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from dlmix.routing.hashing import char_chunk_keys


def _content_text(c: Any) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
    return "" if c is None else str(c)


def chat_text(messages: Sequence[dict]) -> str:
    """Template-free text of a chat conversation (approximate mode)."""
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"<|{m.get('role', '')}|>\n{_content_text(m.get('content'))}\n")
    return "".join(parts)


class PromptExtractor:
    """Turns a parsed request body into (token ids or None, text or None).

    Args:
        tokenizer: HF tokenizer path/id, ``"bytes"``, or None (approximate).
        cache_size: texts whose token ids are cached.
    Raises (on first use) RuntimeError when the tokenizer cannot be loaded.
    """

    def __init__(self, tokenizer: Optional[str] = None, cache_size: int = 4096):
        self.spec = tokenizer
        self._tok = None
        self._split = None
        self._cache: dict = {}
        self.cache_size = cache_size

    @property
    def exact(self) -> bool:
        """True when token ids (not character chunks) are produced."""
        return bool(self.spec)

    def _hf(self):
        if self._tok is None:
            try:
                from transformers import AutoTokenizer

                self._tok = AutoTokenizer.from_pretrained(self.spec)
            except Exception as ex:  # noqa: BLE001 - report any loading failure clearly
                raise RuntimeError(f"cannot load tokenizer {self.spec!r}: {ex}") from ex
            self._setup_split(self._tok)
        return self._tok

    def _setup_split(self, tok) -> None:
        import re

        self._split = None
        self._verify = 3
        bt = getattr(tok, "backend_tokenizer", None)
        if bt is None:
            return
        try:
            added = bt.get_added_tokens_decoder()
        except AttributeError:
            return
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return
        self._bt = bt
        self._added = {t.content: i for i, t in added.items()}
        self._split = re.compile("(" + "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True))
                                 + ")").split
        self._prefix_ids = {True: bt.encode("", add_special_tokens=True).ids, False: []}
        self._seg: dict = {}

    def _split_encode(self, text: str, special: bool) -> List[int]:
        out = list(self._prefix_ids[special])
        seg, added, enc = self._seg, self._added, self._bt.encode
        for i, part in enumerate(self._split(text)):
            if i & 1:
                out.append(added[part])
            elif part:
                ids = seg.get(part)
                if ids is None:
                    ids = enc(part, add_special_tokens=False).ids
                    if len(seg) >= self.cache_size:
                        seg.pop(next(iter(seg)))
                    seg[part] = ids
                out.extend(ids)
        return out

    def _encode(self, text: str, special: bool) -> List[int]:
        key = (text, special)
        ids = self._cache.get(key)
        if ids is None:
            if self.spec == "bytes":
                ids = list(text.encode("utf-8"))
            else:
                tok = self._hf()
                if self._split is not None:
                    ids = self._split_encode(text, special)
                    if self._verify > 0:
                        self._verify -= 1
                        if ids != tok.encode(text, add_special_tokens=special):
                            self._split = None  # this tokenizer does not split cleanly: encode whole texts
                            ids = tok.encode(text, add_special_tokens=special)
                else:
                    ids = tok.encode(text, add_special_tokens=special)
            if self._cache and len(self._cache) >= self.cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = ids
        return ids

    def extract(self, chat: bool, body: dict) -> Tuple[Optional[List[int]], str]:
        """(token ids or None, text) of the prompt in ``body`` (a chat or completions request).

        Unknown shapes give ``(None, "")`` (no prefix information; the request is still routed).
        """
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list):
                return None, ""
            if not self.spec:
                return None, chat_text(msgs)
            if self.spec == "bytes":
                t = chat_text(msgs)
                return self._encode(t, False), t
            tok = self._hf()
            norm = [dict(m, content=_content_text(m.get("content"))) for m in msgs if isinstance(m, dict)]
            kw = body.get("chat_template_kwargs") or {}
            text = tok.apply_chat_template(norm, tokenize=False,
                                           add_generation_prompt=body.get("add_generation_prompt", True), **kw)
            return self._encode(text, bool(body.get("add_special_tokens", False))), text
        p = body.get("prompt")
        if isinstance(p, list) and p:
            if all(isinstance(x, int) for x in p):
                return list(p), ""
            p = p[0]
            if isinstance(p, list):
                return (list(p) if all(isinstance(x, int) for x in p) else None), ""
        if not isinstance(p, str):
            return None, ""
        if not self.spec:
            return None, p
        return self._encode(p, bool(body.get("add_special_tokens", True))), p


def lora_of(model: Any, loras: Mapping[str, str], served: Mapping[str, int]) -> Optional[Tuple[str, Optional[str]]]:
    """The LoRA adapter a request's ``model`` names, as ``(name, path)``, or None for a base model.

    ``loras``: adapters the instances registered (``lora_adapters: {name: path}``): exact, vLLM's key. ``served``:
    every registered model name (adapters included): a name in it that is not an adapter is a base model. A name
    nobody registered is keyed as an adapter of unknown path (``(name, None)``: kept apart from the base model,
    never an exact hit). No model, or no registered names at all: None."""
    if not isinstance(model, str) or not model:
        return None
    path = loras.get(model)
    if path is not None:
        return model, path
    if not served or model in served:
        return None
    return model, None


def prefix_keys(extractor: "PromptExtractor", hasher, chat: bool, body: dict,
                lora: Optional[Tuple[str, Optional[str]]] = None) -> Tuple[int, Callable[[int], List[int]]]:
    """(prompt length in tokens, ``block_size -> block keys`` memoised per block size) of a parsed request body.

    With token ids (tokenizer configured, or a token-id prompt): vLLM's chained block hashes as 64-bit keys
    (:meth:`dlmix.routing.hashing.BlockHasher.block_keys`) with the request's ``cache_salt`` and ``lora``. Without:
    character-chunk keys (:func:`dlmix.routing.hashing.char_chunk_keys`) in the namespace ``(lora name, salt)``;
    the length is then estimated as characters / 4. A tokenizer that cannot be loaded counts as none."""
    try:
        tokens, text = extractor.extract(chat, body)
    except RuntimeError:
        tokens, text = None, ""
    salt = body.get("cache_salt")
    salt = salt if isinstance(salt, str) and salt else None
    cache: dict = {}
    if tokens is not None:
        def bh(bs: int, _t=tokens, _c=cache, _s=salt, _l=lora):
            r = _c.get(bs)
            if r is None:
                r = _c[bs] = hasher.block_keys(_t, bs, _s, _l)
            return r
        return len(tokens), bh
    ns = (lora[0] if lora else None, salt) if (lora or salt) else None

    def bh(bs: int, _t=text, _c=cache, _ns=ns):
        r = _c.get(bs)
        if r is None:
            r = _c[bs] = char_chunk_keys(_t, bs, namespace=_ns)
        return r
    return len(text) // 4, bh
