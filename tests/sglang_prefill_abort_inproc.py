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
import random
import sys
import threading
import time

os.environ["DLMIX_SGLANG_CONFIG"] = '{"staging_bytes": 65536}'
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import sglang_inproc as H  # noqa: E402
import tempfile  # noqa: E402
import torch  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class  # noqa

import dlmix.kv.ops as ops  # noqa: E402


def main():
    model = H.make_model(os.path.join(tempfile.mkdtemp(), "m"), 0)
    port = H._free_port()
    H.DIS.disaggregation_bootstrap_port = port
    get_kv_class(TransferBackend("dlmix"), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    time.sleep(0.5)
    ppool, dpool = H.Pool(16, 40, torch.float32), H.Pool(16, 20, torch.float32)
    pmgr = H.manager(DisaggregationMode.PREFILL, ppool, model)
    dmgr = H.manager(DisaggregationMode.DECODE, dpool, model)
    baddr = f"127.0.0.1:{port}"
    in_round, go = threading.Event(), threading.Event()
    real = ops.convert

    def held_convert(*a, **k):  # the decode's first round waits until the prefill abort went through
        in_round.set()
        go.wait(30)
        return real(*a, **k)

    ops.convert = held_convert
    room = random.getrandbits(62)
    snd = get_kv_class(TransferBackend("dlmix"), KVClassType.SENDER)(pmgr, baddr, room)
    rcv = get_kv_class(TransferBackend("dlmix"), KVClassType.RECEIVER)(dmgr, baddr, room)
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
