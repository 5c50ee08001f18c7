"""Block hashes of a prompt, as vLLM computes them, plus a cheap character-chunk approximation.

Exact mode reproduces vLLM v1 prefix caching (``vllm/v1/core/kv_cache_utils.py``: ``hash_block_tokens``,
``init_none_hash``; ``vllm/utils/hashing.py``: ``sha256_cbor``, ``sha256``), checked against vLLM 0.32:

* block ``i`` hash = ``H((parent_hash, tuple(tokens[i*bs:(i+1)*bs]), extra_keys))``; only full blocks are hashed;
  the first block's parent is ``NONE_HASH``;
* ``NONE_HASH = H(seed)`` where ``seed`` is ``$PYTHONHASHSEED`` of the engine if set, else the fixed string
  ``"vllm-none-hash"`` for the cryptographic algorithms (sha256, sha256_cbor). (Older vLLM used random bytes when
  PYTHONHASHSEED was unset; 0.32 does not for sha256*.) Engines and router must therefore agree on PYTHONHASHSEED:
  configure ``hash_seed`` in the router to the engines' PYTHONHASHSEED, or leave both unset.
* ``H`` = ``sha256_cbor``: SHA-256 of canonical CBOR (engine flag ``--prefix-caching-hash-algo sha256_cbor``), or the
  engine default ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=HIGHEST)`` (same Python pickler, deterministic
  for bytes/tuples of ints/None).
* extra keys (``generate_block_hash_extra_keys``): ``("lora", name, path)`` on every block of a LoRA request
  (``_gen_lora_extra_hash_keys``), then ``("cache_salt", salt)`` on the first block when the request has
  ``cache_salt``; the tuple of those, or None when there are none. Multi-modal and prompt-embeds keys are not
  reproduced (such requests get no exact hits). A LoRA whose path the router does not know is keyed with
  path None: never an exact hit, but never confused with the base model or another adapter either.
* KV events carry ``int.from_bytes(hash, "big") & (2**64-1)`` (``maybe_convert_block_hash`` with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default); the index stores exactly that 64-bit int (:func:`to_key`).

The CBOR encoding of ``(bytes32, (ints...), None)`` is written by hand (memoised per token id), which is several
times faster than ``cbor2.dumps``; ``tests/test_router_hashing.py`` checks equality with vLLM's own functions.

Approximate mode (no tokenizer configured): the prompt text is cut into chunks of ``4 × block_size`` characters
(≈ one block at ~4 chars/token) and chained with Python's ``hash`` (process-local); these keys only ever meet the
router's own approximate index, never engine events. The chain starts from the request's namespace (LoRA adapter
name, cache salt) when it has one, as the engine's keys do, so equal texts under different salts or adapters never
share a key.
"""
from __future__ import annotations

import hashlib
import pickle
import struct
from typing import Any, List, Optional, Sequence, Tuple

MASK64 = (1 << 64) - 1
DEFAULT_SEED = "vllm-none-hash"
ALGOS = ("sha256_cbor", "sha256")

_enc_cache: dict = {}
_ENC_CACHE_MAX = 1 << 18


def _cbor_uint(n: int) -> bytes:
    if n < 24:
        return bytes((n,))
    if n < 256:
        return bytes((0x18, n))
    if n < 65536:
        return b"\x19" + struct.pack(">H", n)
    if n < 1 << 32:
        return b"\x1a" + struct.pack(">I", n)
    return b"\x1b" + struct.pack(">Q", n)


def _cbor_head(major: int, n: int) -> bytes:
    b = _cbor_uint(n)
    return bytes((b[0] | (major << 5),)) + b[1:]


def _cbor_token(t: int) -> bytes:
    b = _enc_cache.get(t)
    if b is None:
        if t < 0:
            raise ValueError(f"negative token id {t}")
        b = _cbor_uint(t)
        if len(_enc_cache) < _ENC_CACHE_MAX:  # bounded: token ids come from clients
            _enc_cache[t] = b
    return b


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of ``cbor2.dumps(obj, canonical=True)`` (32 bytes). Generic, slow path."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def sha256_pickle(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)`` (32 bytes)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash(algo: str = "sha256_cbor", seed: Optional[str] = None) -> bytes:
    """vLLM's ``NONE_HASH`` (32 bytes) for ``algo`` and the engines' PYTHONHASHSEED (None = unset → fixed default).

    Raises ValueError for an unknown algorithm (xxhash variants use a random per-process seed unless PYTHONHASHSEED
    is set and are not supported here).
    """
    s = DEFAULT_SEED if seed is None else seed
    if algo == "sha256_cbor":
        return sha256_cbor(s)
    if algo == "sha256":
        return sha256_pickle(s)
    raise ValueError(f"unsupported prefix caching hash algorithm {algo!r}; use one of {ALGOS}")


def to_key(h) -> int:
    """64-bit index key of a block hash: bytes → low 64 bits big-endian (as vLLM's KV events); int → masked."""
    if isinstance(h, int):
        return h & MASK64
    return int.from_bytes(h, "big") & MASK64


class BlockHasher:
    """Chained vLLM block hashes for one (algorithm, seed).

    Args:
        algo: ``sha256_cbor`` or ``sha256``.
        seed: the engines' PYTHONHASHSEED (None if unset there).
        memo_size: block hashes memoised by (parent, tokens) (as vLLM's own LRU), cleared when full.
    """

    def __init__(self, algo: str = "sha256_cbor", seed: Optional[str] = None, memo_size: int = 1 << 16):
        self.algo = algo
        self.none_hash = none_hash(algo, seed)
        self.memo_size = memo_size
        self._memo: dict = {}

    def hash_block(self, parent: Optional[bytes], tokens: Sequence[int], extra: Optional[tuple] = None) -> bytes:
        """One block hash (32 bytes), as ``hash_block_tokens(H, parent, tokens, extra)``."""
        if not parent:
            parent = self.none_hash
        if self.algo == "sha256":
            return sha256_pickle((parent, tuple(tokens), extra))
        if extra is not None or len(parent) != 32:
            return sha256_cbor((parent, tuple(tokens), extra))
        key = (parent, tuple(tokens))
        h = self._memo.get(key)
        if h is not None:
            return h
        n = len(tokens)
        head = b"\x83\x58\x20" + parent + _cbor_head(4, n)
        enc = _enc_cache
        parts = [enc.get(t) or _cbor_token(t) for t in tokens]
        h = hashlib.sha256(head + b"".join(parts) + b"\xf6").digest()
        memo = self._memo
        if len(memo) >= self.memo_size:
            memo.clear()  # cheap bound; hot prefixes refill at once
        memo[key] = h
        return h

    def block_hashes(self, tokens: Sequence[int], block_size: int, cache_salt: Optional[str] = None,
                     lora: Optional[Tuple[str, Optional[str]]] = None) -> List[bytes]:
        """Hashes (32 bytes each) of every full ``block_size``-token block of ``tokens``, chained from NONE_HASH.

        ``cache_salt``: the request's salt (first block's extra key). ``lora``: ``(adapter name, adapter path)`` of
        a LoRA request (every block's extra key; vLLM's ``("lora", name, path)``)."""
        out: List[bytes] = []
        parent = None
        lk = (("lora", lora[0], lora[1]),) if lora else ()
        rest = lk or None
        first = (lk + (("cache_salt", cache_salt),)) if cache_salt else rest
        for i in range(0, len(tokens) - block_size + 1, block_size):
            parent = self.hash_block(parent, tokens[i : i + block_size], first if i == 0 else rest)
            out.append(parent)
        return out

    def block_keys(self, tokens: Sequence[int], block_size: int, cache_salt: Optional[str] = None,
                   lora: Optional[Tuple[str, Optional[str]]] = None) -> List[int]:
        """Like :meth:`block_hashes` but as 64-bit index keys (:func:`to_key`)."""
        fb = int.from_bytes
        return [fb(h[-8:], "big") for h in self.block_hashes(tokens, block_size, cache_salt, lora)]


def char_chunk_keys(text: str, block_size: int, chars_per_token: int = 4, namespace: Optional[tuple] = None
                    ) -> List[int]:
    """Approximate block keys from text: chained hashes of ``chars_per_token × block_size``-character chunks
    (full chunks only), 64-bit ints. Process-local (Python ``hash``); router-internal approximate index only.

    ``namespace``: hashable that separates requests whose KV the engine keeps apart (e.g. ``(lora name,
    cache_salt)``); the chain starts from its hash. None or all-None: the plain chain."""
    n = block_size * chars_per_token
    out: List[int] = []
    prev = hash(("ns", namespace)) & MASK64 if namespace and any(x is not None for x in namespace) else 0
    for i in range(0, len(text) - n + 1, n):
        prev = hash((prev, text[i : i + n])) & MASK64
        out.append(prev)
    return out
