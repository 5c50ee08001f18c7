"""The dlmix frames on SGLang's ZMQ channels between a prefill rank and its decode peers (first frame :data:`TAG`,
second the kind). Multipart messages, every frame bytes; bodies are JSON, nothing executable.

* ``[TAG, REG, ip, port, body]`` decode -> prefill: a decode rank registers (``body``: its layout, aux item lengths,
  engine rank).
* ``[TAG, META, room, ip, port, body]`` decode -> prefill: the decode of ``room`` waits at ``tcp://ip:port``
  (``body``: ``required_dst_info_num``, ``num_pages``, ``aux_index``, ``decode_prefix_len``, ``is_dummy``,
  ``peer``).
* ``[TAG, READY, room, params, prefill_rank, *aux]`` prefill -> decode: the room's KV is held
  (``params``: :class:`dlmix.pd.contract.TransferParams` JSON; ``aux``: the prefill's metadata row, one frame per
  SGLang metadata buffer, the first being ``output_ids``, int32).
* ``[STATUS_TAG, room, status, prefill_rank, reason]`` prefill -> decode: SGLang's status message (a ``KVPoll``
  value as ASCII digits), e.g. a room that failed on the prefill.
"""
from __future__ import annotations

TAG = b"DLMIX"
REG, META, READY = b"REG", b"META", b"READY"
#: SGLang's kv-status frames of this backend (``DLMixKVManager.kv_status_msg_tag``)
STATUS_TAG = b"DLMIX_STATUS"

__all__ = ["TAG", "REG", "META", "READY", "STATUS_TAG"]
