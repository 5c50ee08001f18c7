"""A prefill started again at the same bootstrap address, driven in one process as SGLang's scheduler drives the
``dlmix`` transfer backend (the harness of ``sglang_inproc.py``: real bootstrap server, prefill and decode managers,
fake pools). Run by ``tests/test_sglang_backend.py`` with the SGLang venv's python; prints one JSON line.

A decode caches what it learned of a prefill's bootstrap address: SGLang its topology and rank addresses, dlmix its
pair-check verdict. SGLang's own backends run a heartbeat checker on the decode that forgets them once the address
stops answering (``_handle_node_failure``). Here the first prefill at the address has other weights (refused); then a
prefill with the right weights registers there, as one started again after the first died would."""
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import sglang_inproc as H  # noqa: E402  (sets up SGLang's runtime context)
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class  # noqa: E402


def main() -> int:
    tmp = tempfile.mkdtemp()
    model, other = H.make_model(os.path.join(tmp, "m"), 0), H.make_model(os.path.join(tmp, "other"), 1)
    port = H._free_port()
    H.DIS.disaggregation_bootstrap_port = port
    get_kv_class(TransferBackend("dlmix"), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    time.sleep(0.5)
    baddr = f"127.0.0.1:{port}"
    H.manager(DisaggregationMode.PREFILL, H.Pool(16, 40, torch.float32), other)
    dmgr = H.manager(DisaggregationMode.DECODE, H.Pool(16, 20, torch.float32), model)
    checker = any(t.name == "HeartbeatChecker" and t.is_alive() for t in threading.enumerate())
    assert dmgr.try_ensure_parallel_info(baddr)
    refused_first = baddr in dmgr.incompatible
    # the prefill with other weights died and one with the right weights registered at the same address; the
    # decode's heartbeat checker has missed the address SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE times
    H.manager(DisaggregationMode.PREFILL, H.Pool(16, 40, torch.float32), model)
    dmgr._handle_node_failure(baddr)
    assert dmgr.try_ensure_parallel_info(baddr)
    out = {"case": "prefill-restarted", "heartbeat_checker": checker, "refused_first": refused_first,
           "refused_after_restart": dmgr.incompatible.get(baddr)}
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
