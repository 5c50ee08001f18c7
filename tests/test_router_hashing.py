"""Block hashes and KV-event decoding equal vLLM's own (imported from the installed vllm; no server)."""
from __future__ import annotations

import random

import pytest

from dlmix.routing.hashing import BlockHasher, char_chunk_keys, none_hash, to_key
from dlmix.router.kv_events.vllm import apply_batch, decode_batch
from dlmix.routing.prefix_index import ApproxIndex, PrefixIndex

kcu = pytest.importorskip("vllm.v1.core.kv_cache_utils")
vh = pytest.importorskip("vllm.utils.hashing")


def _vllm_chain(fn, tokens, bs, extra_first=None):
    out, parent = [], None
    for i in range(0, len(tokens) - bs + 1, bs):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i:i + bs], extra_first if i == 0 else None)
        out.append(parent)
    return out


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256"])
@pytest.mark.parametrize("seed", [None, "0", "12345"])
def test_block_hashes_equal_vllm(monkeypatch, algo, seed):
    fn = vh.get_hash_fn_by_name(algo)
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    kcu.init_none_hash(fn)
    assert none_hash(algo, seed) == kcu.NONE_HASH
    rng = random.Random(7)
    # token ids spanning every CBOR integer width (1, 2, 3, 5 bytes)
    tokens = [rng.choice([rng.randrange(24), rng.randrange(24, 256), rng.randrange(256, 65536),
                          rng.randrange(65536, 1 << 31)]) for _ in range(16 * 9 + 5)]
    h = BlockHasher(algo, seed)
    for bs in (16, 32, 7):
        mine = h.block_hashes(tokens, bs)
        ref = _vllm_chain(fn, tokens, bs)
        assert mine == ref and len(mine) == len(tokens) // bs
        assert h.block_keys(tokens, bs) == [kcu.maybe_convert_block_hash(x) for x in ref]


def test_cache_salt_extra_key_equal_vllm(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kcu.init_none_hash(vh.sha256_cbor)
    tokens = list(range(100, 164))
    ref = _vllm_chain(vh.sha256_cbor, tokens, 16, extra_first=(("cache_salt", "tenant-a"),))
    assert BlockHasher().block_hashes(tokens, 16, cache_salt="tenant-a") == ref
    assert BlockHasher().block_hashes(tokens, 16)[0] != ref[0]


def test_vllm_published_events_decode_and_index():
    ke = pytest.importorskip("vllm.distributed.kv_events")
    import msgspec

    stored = ke.BlockStored(block_hashes=[11, 12, 2**64 - 1], parent_block_hash=None, token_ids=list(range(48)),
                            block_size=16, lora_id=None, medium="GPU", lora_name=None)
    removed = ke.BlockRemoved(block_hashes=[12], medium="GPU")
    payload = msgspec.msgpack.Encoder().encode(ke.KVEventBatch(ts=1.5, events=[stored, removed]))
    b = decode_batch(payload)
    assert b.ts == 1.5 and [type(e).__name__ for e in b.events] == ["BlockStored", "BlockRemoved"]
    assert b.events[0].block_hashes == [11, 12, 2**64 - 1] and b.events[0].token_ids == list(range(48))
    ix = PrefixIndex()
    assert apply_batch(ix, 3, b) == 2
    assert ix.match([11, 12]) == {3: 1} and ix.match([2**64 - 1]) == {3: 1}
    payload = msgspec.msgpack.Encoder().encode(ke.KVEventBatch(ts=2.0, events=[ke.AllBlocksCleared()]))
    apply_batch(ix, 3, decode_batch(payload))
    assert len(ix) == 0
    # 32-byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) map to the same key
    raw = bytes(range(32))
    assert to_key(raw) == kcu.maybe_convert_block_hash(raw) == int.from_bytes(raw[-8:], "big")


def test_index_match_semantics():
    ix = PrefixIndex()
    ix.store(0, [1, 2, 3])
    ix.store(2, [1, 2])
    ix.store(1, [2, 3])  # no first block: no leading match
    assert ix.match([1, 2, 3, 4]) == {0: 3, 2: 2}
    ix.remove(0, [2])
    assert ix.match([1, 2, 3]) == {0: 1, 2: 2}
    ix.clear(2)
    assert ix.match([1, 2, 3]) == {0: 1}
    ap = ApproxIndex(capacity=8)
    ap.record(0, list(range(6)))
    ap.record(1, list(range(100, 106)))  # 12 > 8 -> oldest evicted
    assert len(ap) <= 8 and ap.match(list(range(100, 106))) == {1: 6} and ap.match([0]) == {}


def test_char_chunks_chain():
    a = char_chunk_keys("x" * 130 + "tail", 16)
    b = char_chunk_keys("x" * 128 + "yy", 16)
    assert len(a) == 2 and a == b  # only full 64-char chunks count
    assert char_chunk_keys("y" + "x" * 127, 16)[1] != a[1]  # chained: an early difference changes later keys


def test_lora_and_salt_extra_keys_equal_vllm(monkeypatch):
    """vLLM's own extra-key builder (``generate_block_hash_extra_keys``) on a LoRA request with a salt."""
    from types import SimpleNamespace

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kcu.init_none_hash(vh.sha256_cbor)
    req = SimpleNamespace(lora_request=SimpleNamespace(lora_name="sql", lora_path="/loras/sql"), cache_salt="t",
                          mm_features=[], prompt_embeds=None, _prompt_embeds_per_block_hashes={})
    tokens, bs = list(range(300, 364)), 16
    ref, parent = [], None
    for i in range(0, len(tokens), bs):
        extra, _ = kcu.generate_block_hash_extra_keys(req, i, i + bs, 0)
        parent = kcu.hash_block_tokens(vh.sha256_cbor, parent, tokens[i:i + bs], extra)
        ref.append(parent)
    h = BlockHasher()
    assert h.block_hashes(tokens, bs, cache_salt="t", lora=("sql", "/loras/sql")) == ref
    base = h.block_hashes(tokens, bs, cache_salt="t")
    assert all(a != b for a, b in zip(base, ref))  # every block differs from the base model's


def test_namespaced_char_chunks():
    text = "y" * 200
    plain = char_chunk_keys(text, 16)
    assert char_chunk_keys(text, 16, namespace=(None, None)) == plain
    a, b = char_chunk_keys(text, 16, namespace=(None, "s1")), char_chunk_keys(text, 16, namespace=(None, "s2"))
    assert a == char_chunk_keys(text, 16, namespace=(None, "s1")) and len(a) == len(plain) == 3
    assert not set(a) & set(b) and not set(a) & set(plain)
    assert not set(char_chunk_keys(text, 16, namespace=("lora", None))) & set(plain)
