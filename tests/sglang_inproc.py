"""Drive the SGLang ``dlmix`` transfer backend in one process, as SGLang's scheduler does, without a model or a server:
a real bootstrap server (:class:`DLMixKVBootstrapServer`), a prefill manager and a decode manager over fake KV pools
(torch tensors handed over as SGLang's ``KVArgs``), SGLang's runtime context replaced by plain objects.

Run with the SGLang venv's python (``tests/test_sglang_backend.py`` does): prints one JSON line per case and exits 0
when every case passed. Cases: same page size and dtype (bytes equal); prefill page 4 bf16 -> decode page 16 fp32
(values equal to the bf16 source, re-paged); a prefill with other weights refused at bootstrap with the reason; an
abort from decode frees the prefill's hold; aux (first-token metadata) rows copied.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
import types

os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import dlmix_sglang  # noqa: E402

dlmix_sglang.register()
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

HookRegistry.apply_hooks()

import sglang.srt.disaggregation.common.conn as common  # noqa: E402
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class  # noqa: E402

import dlmix_sglang.conn as dconn  # noqa: E402
from dlmix.kv import read_kv  # noqa: E402

L, H, D = 2, 2, 8


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PAR = types.SimpleNamespace(dist_init_addr=None, attn_tp_size=1, attn_tp_rank=0, attn_cp_size=1, attn_cp_rank=0,
                            attn_dcp_size=1, attn_dcp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_size=1, pp_size=1,
                            nnodes=1, num_dp_ranks=1, pp_group=None, world_group=None, enable_kv_cache_sharding=False,
                            enable_cp_tp_group_sharing=False, enable_dsa_cache_layer_split=False,
                            load_balance_method="follow_bootstrap_room")
DIS = types.SimpleNamespace(disaggregation_bootstrap_port=0, disaggregation_decode_allocation_policy="early",
                            enable_pd_role_switch=False)
SERV = types.SimpleNamespace(host="127.0.0.1", port=30000)
for mod in (common, dconn):
    for name, val in (("get_parallel", PAR), ("get_disagg", DIS), ("get_serving", SERV)):
        if hasattr(mod, name):
            setattr(mod, name, lambda v=val: v)
common.linear_attn_tp_size = lambda: 1


def make_model(dirname: str, seed: int) -> str:
    os.makedirs(dirname, exist_ok=True)
    with open(os.path.join(dirname, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "num_key_value_heads": H,
                   "seed": seed}, f)
    return dirname


class Pool:
    """A fake SGLang MHA pool: K then V buffers per layer, ``[pages * page, H, D]``, plus one aux buffer."""

    def __init__(self, page: int, pages: int, dtype: torch.dtype):
        self.page, self.dtype = page, dtype
        self.k = [torch.zeros(page * pages, H, D, dtype=dtype) for _ in range(L)]
        self.v = [torch.zeros(page * pages, H, D, dtype=dtype) for _ in range(L)]
        self.aux = torch.zeros(16, 8, dtype=torch.int32)
        self.hidden = torch.zeros(16, 4, dtype=dtype)  # SGLang's hidden-states row: model dtype

    def kv_args(self) -> KVArgs:
        a = KVArgs()
        bufs = self.k + self.v
        el = bufs[0].element_size()
        a.engine_rank, a.pp_rank, a.system_dp_rank = 0, 0, 0
        a.kv_data_ptrs = [t.data_ptr() for t in bufs]
        a.kv_data_lens = [t.numel() * el for t in bufs]
        a.kv_item_lens = [self.page * H * D * el] * len(bufs)
        a.kv_layer_ids = list(range(L)) * 2
        a.kv_cache_dtype_str = str(self.dtype)
        a.kv_layout = None
        a.kv_head_num, a.total_kv_head_num, a.page_size = H, H, self.page
        hs = self.hidden.element_size()
        a.aux_data_ptrs = [self.aux.data_ptr(), self.hidden.data_ptr()]
        a.aux_data_lens = [self.aux.numel() * 4, self.hidden.numel() * hs]
        a.aux_item_lens = [32, 4 * hs]
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.state_layer_ids, a.state_dim_per_tensor = [], []
        a.ib_device, a.gpu_id, a.num_draft_entries = "", 0, 0
        a.prefill_start_layer, a.prefill_end_layer = 0, L
        return a


def manager(mode: DisaggregationMode, pool: Pool, model: str):
    cls = get_kv_class(TransferBackend("dlmix"), KVClassType.MANAGER)
    sa = types.SimpleNamespace(model_path=model, dtype="auto", enable_pd_role_switch=False)
    return cls(pool.kv_args(), mode, sa, False)


def abort_rig(decode_pages: int = 20):
    """What the abort scripts (``sglang_abort_inproc.py``, ``sglang_prefill_abort_inproc.py``) share: a bootstrap
    server, a prefill and a decode manager over fp32 pools (40 and ``decode_pages`` pages of 16 tokens), one sender
    and one receiver of a fresh room, and the decode's conversion held until the script lets it go.

    Returns ``(ppool, dpool, pmgr, dmgr, baddr, room, snd, rcv, in_round, go)``: ``in_round`` is set once a conversion
    waits, ``go`` lets it (and every later one) run."""
    import tempfile
    import threading

    import dlmix.kv.ops as ops

    model = make_model(os.path.join(tempfile.mkdtemp(), "m"), 0)
    port = _free_port()
    DIS.disaggregation_bootstrap_port = port
    get_kv_class(TransferBackend("dlmix"), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    time.sleep(0.5)
    ppool, dpool = Pool(16, 40, torch.float32), Pool(16, decode_pages, torch.float32)
    pmgr = manager(DisaggregationMode.PREFILL, ppool, model)
    dmgr = manager(DisaggregationMode.DECODE, dpool, model)
    baddr = f"127.0.0.1:{port}"
    in_round, go = threading.Event(), threading.Event()
    real = ops.convert

    def held_convert(*a, **k):
        in_round.set()
        go.wait(30)
        return real(*a, **k)

    ops.convert = held_convert
    room = random.getrandbits(62)
    snd = get_kv_class(TransferBackend("dlmix"), KVClassType.SENDER)(pmgr, baddr, room)
    rcv = get_kv_class(TransferBackend("dlmix"), KVClassType.RECEIVER)(dmgr, baddr, room)
    return ppool, dpool, pmgr, dmgr, baddr, room, snd, rcv, in_round, go


def wait(fn, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = fn()
        if s in want:
            return s
        time.sleep(0.02)
    raise TimeoutError(f"poll stayed at {fn()}, wanted {want}")


def run_pair(name, ppool, dpool, pmgr, dmgr, baddr, ntok):
    room = random.getrandbits(62)
    sender = get_kv_class(TransferBackend("dlmix"), KVClassType.SENDER)(pmgr, baddr, room)
    recv = get_kv_class(TransferBackend("dlmix"), KVClassType.RECEIVER)(dmgr, baddr, room)
    assert dmgr.try_ensure_parallel_info(baddr)
    recv.init(0)
    if recv.poll() == KVPoll.Failed:
        with dmgr.failure_lock:
            why = dmgr.failure_records.get(room)
        sender.abort()
        return {"case": name, "refused": why}
    # decode allocates its pages (page 0 is padding in SGLang) and tells prefill
    n_dpages = -(-ntok // dpool.page)
    dpages = np.array(random.sample(range(1, len(dpool.k[0]) // dpool.page), n_dpages), dtype=np.int32)
    recv.send_metadata(dpages, aux_index=3)
    assert wait(sender.poll, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    # prefill "computes": random KV in its pages, first-token metadata in aux row 5
    n_ppages = -(-ntok // ppool.page)
    ppages = random.sample(range(1, len(ppool.k[0]) // ppool.page), n_ppages)
    for layer in range(L):
        for t in range(ntok):
            slot = ppages[t // ppool.page] * ppool.page + t % ppool.page
            ppool.k[layer][slot] = torch.randn(H, D).to(ppool.dtype)
            ppool.v[layer][slot] = torch.randn(H, D).to(ppool.dtype)
    ppool.aux[5] = torch.arange(8, dtype=torch.int32) + 100
    ppool.hidden[5] = torch.tensor([0.5, -1.25, 2.0, 3.0]).to(ppool.dtype)
    sender.init(n_ppages, aux_index=5)
    half = max(1, n_ppages // 2)
    sender.send(np.array(ppages[:half], dtype=np.int32), num_kv_tokens=min(ntok, half * ppool.page))
    if half < n_ppages:
        sender.send(np.array(ppages[half:], dtype=np.int32), num_kv_tokens=ntok - half * ppool.page)
    st = wait(recv.poll, (KVPoll.Success, KVPoll.Failed))
    if st != KVPoll.Success:
        with dmgr.failure_lock:
            raise AssertionError(f"{name}: decode failed: {dmgr.failure_records.get(room)}")
    assert wait(sender.poll, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    # compare K/V token by token in fp32 (the source dtype's values)
    for layer in range(L):
        for t in range(ntok):
            ps = ppages[t // ppool.page] * ppool.page + t % ppool.page
            ds = int(dpages[t // dpool.page]) * dpool.page + t % dpool.page
            for a, b in ((ppool.k, dpool.k), (ppool.v, dpool.v)):
                assert torch.equal(a[layer][ps].float(), b[layer][ds].float()), (name, layer, t)
    assert dpool.aux[3].tolist() == list(range(100, 108)), dpool.aux[3]
    assert dpool.hidden[3].float().tolist() == [0.5, -1.25, 2.0, 3.0], dpool.hidden[3]
    sender.clear()
    recv.clear()
    held = pmgr.endpoint.held_count()
    return {"case": name, "tokens": ntok, "ok": True, "prefill_holds_left": held,
            "stats": dmgr.transfer_stats[-1] if dmgr.transfer_stats else None}


def main() -> int:
    import tempfile

    tmp = tempfile.mkdtemp()
    model = make_model(os.path.join(tmp, "m"), 0)
    other = make_model(os.path.join(tmp, "other"), 1)
    results = []

    def boot(model_dir, ppage, pdtype):
        port = _free_port()
        DIS.disaggregation_bootstrap_port = port
        srv = get_kv_class(TransferBackend("dlmix"), KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
        time.sleep(0.5)
        ppool = Pool(ppage, 40, pdtype)
        pmgr = manager(DisaggregationMode.PREFILL, ppool, model_dir)
        return srv, ppool, pmgr, f"127.0.0.1:{port}"

    dpool = Pool(16, 20, torch.float32)
    dmgr = manager(DisaggregationMode.DECODE, dpool, model)
    # same configuration
    srv, ppool, pmgr, baddr = boot(model, 16, torch.float32)
    for ntok in (1, 16, 37, 100):
        results.append(run_pair(f"same/{ntok}", ppool, dpool, pmgr, dmgr, baddr, ntok))
    # page 4 bf16 -> page 16 fp32
    srv2, ppool2, pmgr2, baddr2 = boot(model, 4, torch.bfloat16)
    for ntok in (3, 53):
        results.append(run_pair(f"p4-bf16->p16-fp32/{ntok}", ppool2, dpool, pmgr2, dmgr, baddr2, ntok))
    # other weights: refused at bootstrap with the reason
    srv3, ppool3, pmgr3, baddr3 = boot(other, 16, torch.float32)
    r = run_pair("other-weights", ppool3, dpool, pmgr3, dmgr, baddr3, 10)
    assert r.get("refused") and "weights" in r["refused"], r
    results.append(r)
    # decode aborts after sending its metadata: the prefill room fails with the reason, nothing stays held
    room = random.getrandbits(62)
    snd = get_kv_class(TransferBackend("dlmix"), KVClassType.SENDER)(pmgr, baddr, room)
    rcv = get_kv_class(TransferBackend("dlmix"), KVClassType.RECEIVER)(dmgr, baddr, room)
    rcv.init(0)
    rcv.send_metadata(np.array([1, 2], dtype=np.int32), aux_index=1)
    assert wait(snd.poll, (KVPoll.WaitingForInput,)) == KVPoll.WaitingForInput
    rcv.abort()
    assert wait(snd.poll, (KVPoll.Failed,)) == KVPoll.Failed
    with pmgr.failure_lock:
        why = pmgr.failure_records.get(room)
    assert why and "abort" in why.lower(), why
    snd.clear()
    rcv.clear()
    results.append({"case": "decode-abort", "ok": True, "prefill_reason": why})
    # an abort that overtakes the prefill request: its sender fails at once with the reason
    room = random.getrandbits(62)
    rcv = get_kv_class(TransferBackend("dlmix"), KVClassType.RECEIVER)(dmgr, baddr, room)
    rcv.init(0)
    rcv.abort()
    deadline = time.monotonic() + 10
    while room not in pmgr.early_aborts and time.monotonic() < deadline:
        time.sleep(0.02)
    snd = get_kv_class(TransferBackend("dlmix"), KVClassType.SENDER)(pmgr, baddr, room)
    assert snd.poll() == KVPoll.Failed
    snd.clear()
    rcv.clear()
    results.append({"case": "early-abort", "ok": True})
    time.sleep(0.5)
    for m in (pmgr, pmgr2, pmgr3):
        m.endpoint.take_finished()
    left = [m.endpoint.held_count() for m in (pmgr, pmgr2, pmgr3)]
    results.append({"case": "holds-left", "counts": left})
    for r in results:
        print(json.dumps(r, default=str))
    assert left == [0, 0, 0], left
    print("ALL OK")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
