"""Seeded generator of invalid PD contract inputs (transfer parameters and control messages) for the fuzz tests.

Every case is built to be invalid under :mod:`dlmix.pd.contract` by construction, from a valid object, by one
mutation of a kind listed in :data:`KINDS`; the generator never asks the contract which cases are invalid (that
would make the test circular). ``case.kind`` names the mutation so a failure says what slipped through.
"""
from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from typing import Any

from dlmix.kv import KVLayout, ModelIdentity

#: A small valid layout (the tiny test model's shape) used inside valid objects.
LAYOUT = KVLayout(ModelIdentity("LlamaForCausalLM", 2, 2, 32, "gqa", weights_fingerprint="sha256:" + "ab" * 16),
                  block_size=16, dtype="fp16", arrangement="vllm_lbnhc", engine="reference")
TRANSPORT = {"kind": "tcp", "name": "ref-producer", "host": "127.0.0.1", "port": 45678, "proto": 1,
             "regions": {"L0": 4096}}
DIGEST = "sha256:" + "0" * 64

#: Required keys of the wire form of the parameters and of each control message (besides ``type``).
PARAM_REQUIRED = ("contract_version", "remote_engine", "remote_engine_id", "remote_transports", "remote_request_id",
                  "remote_block_ids", "remote_num_tokens", "remote_layout")
MSG_REQUIRED = {"want": ("req", "block_ids", "layout"), "blocks_ready": ("req",), "refused": ("req", "reasons"),
                "extend": ("req",), "blocks_consumed": ("req",), "abort": ("req",)}
TO_PRODUCER = ("want", "extend", "blocks_consumed", "abort")
TO_CONSUMER = ("blocks_ready", "refused")

KINDS = ("missing", "unknown_field", "wrong_type", "version", "tag", "garbage", "semantic")


@dataclass
class Case:
    """One invalid input: ``target`` is ``params`` or the control message direction (``to_producer`` /
    ``to_consumer``), ``obj`` the dict (or other JSON value / raw bytes), ``kind`` the mutation."""

    target: str
    kind: str
    obj: Any
    what: str


def valid_params(req: str = "req-1", block_ids: list[int] | None = None, num_tokens: int = 40) -> dict[str, Any]:
    """A valid parameters dict (wire names)."""
    return {"contract_version": 1, "remote_engine": "reference", "remote_engine_id": "ref-0",
            "remote_transports": [dict(TRANSPORT)], "remote_request_id": req,
            "remote_block_ids": list(block_ids if block_ids is not None else [3, 4, 5]),
            "remote_num_tokens": num_tokens, "remote_layout": LAYOUT.to_dict(), "remote_prompt_digest": DIGEST,
            "remote_expiry_s": 30.0, "transfer_mode": "dlmix-pull"}


def valid_message(typ: str, req: str = "req-1", block_ids: list[int] | None = None) -> dict[str, Any]:
    """A valid control message dict of type ``typ``."""
    m: dict[str, Any] = {"type": typ, "req": req, "v": 1}
    if typ == "want":
        m.update(block_ids=list(block_ids if block_ids is not None else [3, 4, 5]), layout=LAYOUT.to_dict(),
                 digest=DIGEST)
    elif typ == "refused":
        m["reasons"] = ["no"]
    return m


# Values of the wrong type for a field of each kind (strict decoding: no coercion between str/int/bool/float).
def _not_int(r: random.Random) -> Any:
    return r.choice([None, "7", 3.5, True, False, [1], {"n": 1}, "", -1, -(2 ** 40), 2 ** 70])


def _not_str(r: random.Random) -> Any:
    return r.choice([None, 7, 3.5, True, ["a"], {"s": "a"}, "", "x" * 600])


def _not_int_list(r: random.Random) -> Any:
    return r.choice([None, "3,4,5", 3, {"0": 3}, [3, "4"], [3, -4], [3.5], [True], [[3]], [None]])


def _not_layout(r: random.Random) -> Any:
    good = LAYOUT.to_dict()
    bad = copy.deepcopy(good)
    how = r.randrange(8)
    if how == 0:
        return r.choice([None, "vllm_cpu", 3, [good]])
    if how == 1:
        bad["arrangement"] = r.choice(["nhd", "", 5, None])
    elif how == 2:
        bad["block_size"] = r.choice([0, -16, "16", None])
    elif how == 3:
        bad["dtype"] = r.choice(["int4", "", 2, None])
    elif how == 4:
        bad["model"] = r.choice([None, "llama", {"architecture": "x"}, []])
    elif how == 5:
        bad["surprise"] = 1
    elif how == 6:
        bad["model"] = dict(good["model"], num_layers=r.choice([0, -2, "2", None]))
    else:
        del bad[r.choice(["model", "block_size", "dtype", "arrangement"])]
    return bad


def _not_transports(r: random.Random) -> Any:
    how = r.randrange(7)
    if how == 0:
        return r.choice([None, "tcp://127.0.0.1:1", 5, {"kind": "tcp"}])
    if how == 1:
        return []
    if how == 2:
        return [r.choice([None, "tcp", 3, []])]
    t = dict(TRANSPORT)
    if how == 3:
        del t[r.choice(["kind", "name"])]
    elif how == 4:
        t["port"] = r.choice([-1, 70000, "45678", None, 1.5])
    elif how == 5:
        t[r.choice(["kind", "name"])] = r.choice(["", 3, None, ["tcp"]])
    else:
        t["auth"] = r.choice(["none", "plain", 1])
    return [t]


def _not_digest(r: random.Random) -> Any:
    return r.choice([7, ["sha256:"], "sha256:xyz", "md5:" + "0" * 32, "sha256:" + "0" * 63, "SHA256:" + "0" * 64,
                     "sha256:" + "G" * 64, ""])


def _not_float(r: random.Random) -> Any:
    return r.choice([None, "30", [30.0], {"s": 30}, -1.0, True])


def _not_version(r: random.Random) -> Any:
    return r.choice([0, 2, 3, -1, 99, 2 ** 40, "1", "v1", 1.5, None, True, [1], {"v": 1}])


PARAM_FIELDS = {
    "contract_version": _not_version, "remote_engine": _not_str, "remote_engine_id": _not_str,
    "remote_transports": _not_transports, "remote_request_id": _not_str, "remote_block_ids": _not_int_list,
    "remote_num_tokens": _not_int, "remote_layout": _not_layout, "remote_prompt_digest": _not_digest,
    "remote_expiry_s": _not_float, "transfer_mode": lambda r: r.choice(["push", "", None, 1]),
}
MSG_FIELDS = {"req": _not_str, "v": _not_version, "block_ids": _not_int_list, "layout": _not_layout,
              "digest": _not_digest, "reasons": lambda r: r.choice([None, "no", [], [1], [None], {"r": "no"}]),
              "send_layout": lambda r: r.choice([None, "yes", 1, 0, [True]])}


def _garbage(r: random.Random, depth: int = 0) -> Any:
    k = r.randrange(9 if depth < 3 else 6)
    if k == 0:
        return None
    if k == 1:
        return r.randrange(-2 ** 40, 2 ** 40)
    if k == 2:
        return r.random() * 1e6
    if k == 3:
        return "".join(chr(r.randrange(32, 0x2FF)) for _ in range(r.randrange(12)))
    if k == 4:
        return r.choice([True, False])
    if k == 5:
        return r.choice(["want", "blocks_ready", "refused", "abort", "remote_layout", "contract_version"])
    if k == 6:
        return [_garbage(r, depth + 1) for _ in range(r.randrange(4))]
    keys = ["type", "req", "v", "block_ids", "layout", "remote_request_id", "x", "contract_version"]
    return {r.choice(keys): _garbage(r, depth + 1) for _ in range(r.randrange(4))}


def _garbage_case(r: random.Random, target: str) -> Case:
    g = _garbage(r)
    if isinstance(g, dict):
        # a random dict could by chance be valid only if it had every required key: make sure it lacks one
        g.pop("remote_layout" if target == "params" else "req", None)
        if target != "params" and r.random() < 0.5:
            g.pop("type", None)
    if target != "params" and r.random() < 0.3:
        raw = json.dumps(g).encode() if r.random() < 0.5 else bytes(r.randrange(256) for _ in range(r.randrange(40)))
        if raw[:1] != b"{":
            return Case(target, "garbage", raw, "raw bytes")
        return Case(target, "garbage", b"[" + raw, "raw bytes")
    return Case(target, "garbage", g, f"random value {type(g).__name__}")


def _param_case(r: random.Random, kind: str, req: str, block_ids: list[int], num_tokens: int) -> Case:
    p = valid_params(req, block_ids, num_tokens)
    if kind == "missing":
        k = r.choice(PARAM_REQUIRED)
        del p[k]
        return Case("params", kind, p, f"without {k}")
    if kind == "unknown_field":
        k = r.choice(["remote_host", "remote_port", "extra", "remote_blocks", "Remote_request_id", "contract"])
        p[k] = _garbage(r)
        return Case("params", kind, p, f"unknown key {k}")
    if kind == "wrong_type":
        k = r.choice([x for x in PARAM_FIELDS if x != "contract_version"])
        p[k] = PARAM_FIELDS[k](r)
        return Case("params", kind, p, f"{k}={p[k]!r:.60}")
    if kind == "version":
        p["contract_version"] = _not_version(r)
        return Case("params", kind, p, f"contract_version={p['contract_version']!r}")
    if kind == "semantic":
        lay = LAYOUT.block_size
        p["remote_num_tokens"] = len(p["remote_block_ids"]) * lay + r.randrange(1, 500)
        return Case("params", kind, p, "more tokens than the blocks hold")
    if kind == "tag":  # params have no tag: send a control message where parameters are expected
        return Case("params", kind, valid_message(r.choice(list(MSG_REQUIRED)), req), "a control message")
    return _garbage_case(r, "params")


def _msg_case(r: random.Random, kind: str, target: str, req: str, block_ids: list[int]) -> Case:
    typ = r.choice(TO_PRODUCER if target == "to_producer" else TO_CONSUMER)
    m = valid_message(typ, req, block_ids)
    if kind == "missing":
        k = r.choice(("type",) + MSG_REQUIRED[typ])
        del m[k]
        return Case(target, kind, m, f"{typ} without {k}")
    if kind == "unknown_field":
        k = r.choice(["reqs", "blocks", "extra", "Type", "layout2", "remote_request_id"] +
                     ([] if typ == "want" else ["block_ids", "digest"]))
        m[k] = _garbage(r)
        return Case(target, kind, m, f"{typ} with unknown key {k}")
    if kind == "wrong_type":
        keys = [k for k in m if k in MSG_FIELDS and k != "v"] + (["send_layout"] if typ == "want" else [])
        k = r.choice(keys)
        m[k] = MSG_FIELDS[k](r)
        return Case(target, kind, m, f"{typ}.{k}={m[k]!r:.60}")
    if kind == "version":
        m["v"] = _not_version(r)
        return Case(target, kind, m, f"{typ} v={m['v']!r}")
    if kind == "tag":
        m["type"] = r.choice(["grant", "WANT", "ready", "", None, 1, ["want"], "consumed", "release"])
        return Case(target, kind, m, f"type={m['type']!r}")
    if kind == "semantic":  # params sent on the control channel
        return Case(target, kind, valid_params(req, block_ids), "transfer parameters as a control message")
    return _garbage_case(r, target)


def generate(n: int, seed: int = 0, *, targets: tuple[str, ...] = ("params", "to_producer", "to_consumer"),
             reqs: list[tuple[str, list[int], int]] | None = None) -> list[Case]:
    """``n`` invalid cases, kinds and targets spread evenly (round robin), values drawn from ``Random(seed)``.

    ``reqs``: ``(request id, block ids, num tokens)`` of real holds to aim at (so a mutated message names a request
    the producer really holds); default one made-up request.
    """
    r = random.Random(seed)
    reqs = reqs or [("req-1", [3, 4, 5], 40)]
    out = []
    for i in range(n):
        target = targets[i % len(targets)]
        kind = KINDS[(i // len(targets)) % len(KINDS)]
        req, bids, ntok = reqs[r.randrange(len(reqs))]
        if target == "params":
            out.append(_param_case(r, kind, req, bids, ntok))
        else:
            out.append(_msg_case(r, kind, target, req, bids))
    return out
