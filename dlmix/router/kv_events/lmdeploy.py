"""LMDeploy's KV cache events, as dlmix's LMDeploy adapter publishes them (LMDeploy 0.18 publishes none).

With ``kv_events_endpoint`` in ``DLMIX_LMDEPLOY_CONFIG`` and ``--enable-prefix-caching``, the engine process
(:mod:`dlmix_lmdeploy.kv_events`) publishes its prefix-cache trie (``pytorch/paging/block_trie``): one ``BlockStored``
per block attached to the trie (``block_hashes`` = ``[the node's block hash]``, ``parent_block_hash`` = its parent
node's hash or None at the root, ``token_ids`` = the block's tokens, ``block_size``) and one ``BlockRemoved`` per
evicted leaf, on a ZMQ PUB socket, in the wire format SGLang uses (:mod:`dlmix.router.kv_events.sglang`: multipart
``[topic, seq, payload]``, msgpack ``[ts, events, attn_dp_rank]``). LMDeploy's block hashes are its own, so the router
re-hashes the published token ids with its own hasher, as for SGLang: this module is SGLang's stateful decoder.
"""
from __future__ import annotations

from dlmix.router.kv_events.sglang import (AllBlocksCleared, BlockRemoved, BlockStored, Decoder, KVEventBatch,
                                           encode_batch, make)

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "encode_batch", "Decoder", "make"]
