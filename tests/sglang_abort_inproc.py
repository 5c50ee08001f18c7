"""A decode request aborted while its pull is inside a round, driven in one process as SGLang's scheduler drives the
``dlmix`` transfer backend (the harness of ``sglang_inproc.py``: real bootstrap server, prefill and decode managers,
fake pools). Run by ``tests/test_sglang_backend.py`` with the SGLang venv's python; prints one JSON line.

``DLMixKVReceiver.abort()`` drops the room's destination; SGLang's decode transfer queue frees a room's pages as soon
as its receiver polls Failed (``failure_exception``, then ``_release_request``: the backend supports no deferred
release). The pull looks at cancellation only between rounds, so the receiver must report Transferring until the
round that is running has ended, and a failure recorded after SGLang cleared the room would stay for ever."""
import json
import os
import sys
import threading
import time

# a page is 2 layers x K,V x 16 tokens x 2 heads x 8 x fp32 = 4096 B: a 64 KiB staging region holds 16 pages per
# round, so the 17-page prompt below takes two rounds
os.environ["DLMIX_SGLANG_CONFIG"] = '{"staging_bytes": 65536}'
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import sglang_inproc as H  # noqa: E402  (sets up SGLang's runtime context)
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402



def main() -> int:
    # the decode's conversion waits for `go` (in_round: it has started)
    ppool, dpool, pmgr, dmgr, baddr, room, snd, rcv, in_round, go = H.abort_rig()
    assert dmgr.try_ensure_parallel_info(baddr)
    rcv.init(0)
    rcv.send_metadata(np.arange(2, 19, dtype=np.int32), aux_index=3)  # 17 decode pages
    assert H.wait(snd.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    ntok = 17 * 16
    for layer in range(H.L):
        ppool.k[layer][16:16 + ntok] = 1.0
        ppool.v[layer][16:16 + ntok] = 1.0
    snd.init(17, aux_index=5)
    snd.send(np.arange(1, 18, dtype=np.int32), num_kv_tokens=ntok)
    assert in_round.wait(30), "the pull never reached its conversion"
    rcv.abort()  # the client went away (scheduler.py abort -> kv_receiver.abort())
    threading.Timer(1.0, go.set).start()  # the round goes on for another second
    while True:  # SGLang's decode transfer queue: poll each step; on Failed it frees the room's pages
        st = rcv.poll()
        if st in (KVPoll.Success, KVPoll.Failed):
            break
        time.sleep(0.02)
    early = not go.is_set()  # Failed while the round still ran: its pages would be freed under it
    try:
        rcv.failure_exception()
    except Exception:
        pass
    for layer in range(H.L):  # the freed pages go to another request, which writes its KV (7.0)
        dpool.k[layer][2 * 16:19 * 16] = 7.0
    go.wait(30)
    time.sleep(1.0)
    overwritten = int((dpool.k[0][2 * 16:19 * 16] == 1.0).all(-1).all(-1).sum())
    out = {"case": "abort-during-pull", "failed_while_pulling": early, "overwritten_slots": overwritten,
           "failure_record_left": room in dmgr.failure_records, "status_left": room in dmgr.request_status}
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
