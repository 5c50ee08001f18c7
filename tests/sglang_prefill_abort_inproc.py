"""SGLang prefill: a prefill request aborted (AbortReq -> DLMixKVSender.abort) while a decode is reading
its granted hold; the decode then finishes and says blocks_consumed. The abort recorded a failure reason
(_abort_room -> record_failure), but the release hook (_released, why="consumed") sets the room Success with a
plain update_status, so SGLang's Success path clears the sender and nobody ever pops failure_records[room]: one
entry per such abort stayed for ever (and a later request reusing the room inherited it as its root cause); the
sender's clear() now pops it when the room ended Success.

Run: SGLANG_USE_CPU_ENGINE=1 .venv-sglang/bin/python tests/sglang_prefill_abort_inproc.py  (exit 0: no record left;
tests/test_sglang_backend.py runs it)
"""
import json
import os
import sys

os.environ["DLMIX_SGLANG_CONFIG"] = '{"staging_bytes": 65536}'
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import sglang_inproc as H  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402



def main():
    # the decode's conversion waits for `go` (in_round: it has started)
    ppool, dpool, pmgr, dmgr, baddr, room, snd, rcv, in_round, go = H.abort_rig()
    assert dmgr.try_ensure_parallel_info(baddr)
    rcv.init(0)
    rcv.send_metadata(np.arange(2, 4, dtype=np.int32), aux_index=3)
    assert H.wait(snd.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    snd.init(2, aux_index=5)
    snd.send(np.arange(1, 3, dtype=np.int32), num_kv_tokens=20)
    assert in_round.wait(30), "the pull never reached its conversion"
    snd.abort()  # the client of the prefill leg went away (scheduler abort -> disagg_kv_sender.abort())
    st_after_abort = snd.poll()
    go.set()
    # SGLang's prefill inflight queue: poll until terminal, then Success -> clear(), Failed -> failure_exception()
    st = H.wait(snd.poll, (KVPoll.Success, KVPoll.Failed))
    if st == KVPoll.Success:
        snd.clear()
    else:
        try:
            snd.failure_exception()
        except Exception:
            pass
    H.wait(rcv.poll, (KVPoll.Success, KVPoll.Failed))
    with pmgr.failure_lock:
        left = pmgr.failure_records.get(room)
    name = {v: k for k, v in vars(KVPoll).items() if not k.startswith("_") and isinstance(v, int)}
    out = {"poll_right_after_abort": name[st_after_abort], "prefill_final": name[st], "failure_record_left": left,
           "status_left": room in pmgr.request_status}
    print(json.dumps(out))
    sys.stdout.flush()
    ok = left is None and not out["status_left"]
    print("OK" if ok else "DEFECT: failure record of an aborted room stays after the sender was cleared")
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
