"""The PD transfer contract (dlmix.pd.contract), the pair check, the registration builder and the router's engine
adapter interface: exact round trips, refusals with reasons, and a hypothesis fuzz of both decode functions
(random fields, types and versions are refused with a ContractError, never a KeyError/TypeError)."""
from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlmix.kv import KVLayout, ModelIdentity
from dlmix.pd import check_pair
from dlmix.pd.contract import (
    CONTRACT_VERSION,
    Abort,
    Consumed,
    ContractError,
    Extend,
    Ready,
    Refuse,
    TransferParams,
    Want,
    decode_message,
    decode_params,
    encode,
    prompt_digest,
)
from dlmix.pd.registration import decode_registration, registration_body


def _layout(bs: int = 32, dtype: str = "bf16", fp: str = "sha256:aa", arrangement: str = "vllm_cpu",
            layers: int = 3, tp: int = 1) -> KVLayout:
    ident = ModelIdentity("LlamaForCausalLM", layers, 2, 32, "gqa", weights_fingerprint=fp)
    return KVLayout(model=ident, block_size=bs, dtype=dtype, arrangement=arrangement, tp_size=tp)


TRANSPORT = {"kind": "tcp", "proto": "dlmix-kv/1", "name": "w0", "host": "127.0.0.1", "port": 5555, "regions": {}}


def _params(**kw) -> TransferParams:
    args = dict(engine="vllm", instance_id="e1", transports=[TRANSPORT], request_id="r1", block_ids=[4, 5, 9],
                num_tokens=70, layout=_layout(), token_ids=list(range(70)), expiry_s=30.0)
    args.update(kw)
    return TransferParams.make(**args)


def test_prompt_digest_is_sha256_of_le_int32():
    ids = [1, 2, 3, 128000, 2 ** 31 - 1]
    want = "sha256:" + hashlib.sha256(struct.pack("<5i", *ids)).hexdigest()
    assert prompt_digest(ids) == want
    assert prompt_digest([]) == "sha256:" + hashlib.sha256(b"").hexdigest()
    assert prompt_digest([1, 2]) != prompt_digest([2, 1])
    with pytest.raises(ContractError, match="int32"):
        prompt_digest([2 ** 31])
    with pytest.raises(ContractError, match="integer"):
        prompt_digest([1, "2"])


def test_params_round_trip_and_vllm_wire_names():
    p = _params()
    d = p.to_dict()
    assert d["contract_version"] == CONTRACT_VERSION and d["transfer_mode"] == "dlmix-pull"
    assert d["remote_request_id"] == "r1" and d["remote_block_ids"] == [4, 5, 9] and d["remote_num_tokens"] == 70
    assert d["remote_transports"][0] == TRANSPORT  # kept whole: connect() needs the transport-specific keys
    assert d["remote_prompt_digest"] == prompt_digest(range(70))
    assert KVLayout.from_dict(d["remote_layout"]) == _layout()
    # vLLM's envelope flags are ignored; everything else must be the contract's
    assert decode_params({**d, "do_remote_prefill": True, "do_remote_decode": False,
                          "remote_prefill_cached_tokens": 64}) == p
    assert p.kv_layout == _layout() and p.transport_for_rank(0) == TRANSPORT
    with pytest.raises(ContractError, match="no transport for rank 1"):
        p.transport_for_rank(1)


@pytest.mark.parametrize("mutate, reason", [
    (lambda d: d.pop("contract_version"), "no contract_version"),
    (lambda d: d.update(contract_version=2), "unsupported contract version 2"),
    (lambda d: d.update(contract_version="1"), "unsupported contract version '1'"),
    (lambda d: d.pop("remote_block_ids"), "missing required field `remote_block_ids`"),
    (lambda d: d.update(remote_num_tokens="70"), "Expected `int`, got `str` - at `$.remote_num_tokens`"),
    (lambda d: d.update(remote_block_ids=[1, -2]), "remote_block_ids"),
    (lambda d: d.update(remote_num_tokens=200), "200 tokens need 7 blocks of 32"),
    (lambda d: d.update(surprise=1), "unknown field `surprise`"),
    (lambda d: d.update(remote_layout={"model": {}}), "remote_layout is not a valid KV layout"),
    (lambda d: d.update(remote_transports=[]), "remote_transports"),
    (lambda d: d.update(remote_transports=[{"kind": "tcp", "port": 1}]), "missing required field `name`"),
    (lambda d: d.update(remote_transports=[{**TRANSPORT, "port": 70000}]), "remote_transports[0]"),
    (lambda d: d.update(remote_prompt_digest="md5:00"), "prompt digest must be"),
    (lambda d: d.update(transfer_mode="push"), "transfer_mode"),
])
def test_params_refused_with_reason(mutate, reason):
    d = _params().to_dict()
    mutate(d)
    with pytest.raises(ContractError) as e:
        decode_params(d)
    assert reason in e.value.reason


def test_params_not_an_object():
    for bad in (None, [], "x", 3):
        with pytest.raises(ContractError, match="must be an object"):
            decode_params(bad)


def test_control_messages_round_trip():
    lay = _layout().to_dict()
    msgs = [Want(req="r", block_ids=[1, 2], layout=lay, digest=prompt_digest([1])), Ready(req="r"),
            Ready(req="r", layout=lay), Refuse(req="r", reasons=["no"]), Extend(req="r"), Consumed(req="r"),
            Abort(req="r")]
    for m in msgs:
        d = encode(m)
        assert d["v"] == CONTRACT_VERSION and isinstance(d["type"], str)
        assert decode_message(d) == m
    # the short form without "v" is the current version
    assert decode_message({"type": "blocks_consumed", "req": "x"}) == Consumed(req="x")
    assert decode_message(b'{"type": "abort", "req": "x"}') == Abort(req="x")


@pytest.mark.parametrize("msg, reason", [
    ({"type": "nope", "req": "r"}, "unknown control message type 'nope'"),
    ({"req": "r"}, "unknown control message type None"),
    ({"type": "extend", "req": "r", "v": 9}, "unsupported contract version 9"),
    ({"type": "want", "req": "r"}, "missing required field `block_ids`"),
    ({"type": "want", "req": "r", "block_ids": [1], "layout": {"x": 1}}, "want.layout is not a valid KV layout"),
    ({"type": "refused", "req": "r", "reasons": []}, "reasons"),
    ({"type": "extend", "req": 5}, "Expected `str`, got `int`"),
    ({"type": "extend", "req": ""}, "req"),
    ({"type": "abort", "req": "r", "extra": 1}, "unknown field `extra`"),
    (b"{not json", "not JSON"),
    ([1, 2], "must be an object"),
])
def test_control_messages_refused_with_reason(msg, reason):
    with pytest.raises(ContractError) as e:
        decode_message(msg)
    assert reason in e.value.reason


def test_pair_check_reasons():
    a = _layout()
    assert check_pair(a, _layout(128, "fp32")) == []
    assert check_pair(a, _layout(64, "fp16", arrangement="lmdeploy")) == []  # arrangements are converted
    r = check_pair(a, _layout(fp="sha256:bb"))
    assert len(r) == 1 and "fingerprint" in r[0]
    assert check_pair(a, _layout(fp="sha256:bb"), verify_weights=False) == []
    assert any("layers" in x for x in check_pair(a, _layout(layers=4)))
    assert check_pair(a, _layout(tp=2)) == []  # each consumer rank reads its heads from the producer ranks holding them
    assert check_pair({"nonsense": 1}, a)[0].startswith("malformed layout descriptor")
    assert check_pair(a, None)[0].startswith("malformed layout descriptor")  # type: ignore[arg-type]


def test_registration_builder_and_validation():
    lay = _layout(128)
    body = registration_body(url="http://127.0.0.1:8100/", role="prefill", engine="vllm", instance_id="p0",
                             model="smollm2", chip="cpu-x86", kv_layout=lay, transport=TRANSPORT,
                             kv_events="tcp://127.0.0.1:5557", heartbeat_ttl_s=6)
    assert body == {"url": "http://127.0.0.1:8100", "id": "p0", "role": "prefill", "engine": "vllm",
                    "model": "smollm2", "chip": "cpu-x86", "block_size": 128, "kv_layout": lay.to_dict(),
                    "transport": TRANSPORT, "kv_events": "tcp://127.0.0.1:5557", "heartbeat_ttl_s": 6.0,
                    "contract_version": CONTRACT_VERSION}
    static = registration_body(url="http://127.0.0.1:8101", instance_id="m", heartbeat_ttl_s=0, block_size=16)
    assert static == {"url": "http://127.0.0.1:8101", "id": "m", "block_size": 16, "heartbeat_ttl_s": 0.0,
                      "role": "both", "engine": "vllm"}
    for kw, reason in [({"url": "ftp://x"}, "url must be"), ({"url": "http://h:1", "role": "boss"}, "role"),
                       ({"url": "http://h:1", "kv_layout": lay, "block_size": 16}, "differs from kv_layout"),
                       ({"url": "http://h:1", "kv_layout": {"model": 1}}, "kv_layout")]:
        with pytest.raises(ContractError, match=reason):
            registration_body(**kw)
    with pytest.raises(ContractError, match="contract version"):
        decode_registration({"url": "http://h:1", "contract_version": 99})


def test_registration_body_accepted_by_router():
    from dlmix.router.config import RouterConfig
    from dlmix.router.server import Router

    router = Router(RouterConfig())
    for role, port, bs in (("prefill", 8100, 32), ("decode", 8101, 128)):
        st_ = router.register(registration_body(url=f"http://127.0.0.1:{port}", role=role, instance_id=role,
                                                kv_layout=_layout(bs), transport=TRANSPORT, chip="cpu-x86"))
        assert (st_.role, st_.block_size) == (role, bs)


def test_router_engine_adapters_implement_the_protocol():
    from dlmix.router.engines import ENGINES, get_engine
    from dlmix.router.engines.base import EngineAdapter

    for name, mod in ENGINES.items():
        assert isinstance(mod, EngineAdapter) and mod.NAME == name
    vllm = get_engine("vllm")
    d = _params().to_dict()
    import msgspec

    assert vllm.kv_transfer_params(msgspec.json.encode({"kv_transfer_params": d})) == d
    out = msgspec.json.decode(vllm.decode_body(b'{"prompt": "hi"}', d))
    assert decode_params(out["kv_transfer_params"]) == _params()
    with pytest.raises(ValueError, match="unknown engine"):
        get_engine("tgi")


# ------------------------------------------------------------------------------------------------ fuzz
_json = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 40, 2 ** 40) | st.floats(allow_nan=False)
                     | st.text(max_size=12), lambda c: st.lists(c, max_size=4)
                     | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)

_PARAM_KEYS = list(_params().to_dict())
_MSG_KEYS = ["type", "req", "v", "block_ids", "layout", "digest", "send_layout", "reasons"]


@st.composite
def _mutated_params(draw):
    d = _params().to_dict()
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["drop", "retype", "add", "version"]))
        if op == "drop":
            d.pop(draw(st.sampled_from(_PARAM_KEYS)), None)
        elif op == "retype":
            k = draw(st.sampled_from(_PARAM_KEYS))
            d[k] = draw(_json.filter(lambda v, k=k: v != d.get(k)))
        elif op == "add":
            d[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in _PARAM_KEYS and k not in
                                                          ("do_remote_prefill", "do_remote_decode",
                                                           "remote_prefill_cached_tokens",
                                                           "_dlmix_consumer")))] = draw(_json)
        else:
            d["contract_version"] = draw(_json.filter(lambda v: v != CONTRACT_VERSION))
    return d


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_params())
def test_fuzz_params_refused_with_reason(d):
    try:
        p = decode_params(d)
    except ContractError as e:
        assert e.reason and isinstance(e.reason, str)
        return
    # the only way through is a mutation that kept a valid value (e.g. another valid digest or expiry)
    assert p.version == CONTRACT_VERSION and p.to_dict().keys() <= set(_PARAM_KEYS)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_json, st.dictionaries(st.sampled_from(_MSG_KEYS), _json, max_size=6),
                 st.builds(lambda t, extra: {"type": t, "req": "r", **extra},
                           st.sampled_from(["want", "blocks_ready", "refused", "extend", "blocks_consumed",
                                            "abort"]),
                           st.dictionaries(st.sampled_from(_MSG_KEYS[2:]) | st.text(max_size=6), _json,
                                           max_size=3))))
def test_fuzz_control_messages_refused_with_reason(m):
    try:
        msg = decode_message(m)
    except ContractError as e:
        assert e.reason and isinstance(e.reason, str)
        return
    assert encode(msg)["type"] == m["type"] and msg.v == CONTRACT_VERSION


def test_a_digest_with_a_trailing_newline_is_refused_as_malformed():
    """``$`` in a pattern also matches before a final newline: ``"sha256:<64 hex>\\n"`` passed as a digest and was
    then refused as a different prompt. Now it is a contract error, in the parameters and in a want."""
    import json

    good = prompt_digest([1, 2, 3])
    params = TransferParams.make(engine="e", instance_id="i", transports=[TRANSPORT], request_id="r",
                                 block_ids=[1], num_tokens=20, layout=_layout(), digest=good).to_dict()
    with pytest.raises(ContractError, match="prompt digest must be"):
        decode_params({**params, "remote_prompt_digest": good + "\n"})
    want = {"type": "want", "req": "r", "block_ids": [1], "layout": _layout().to_dict()}
    assert isinstance(decode_message(json.dumps({**want, "digest": good})), Want)
    with pytest.raises(ContractError, match="prompt digest must be"):
        decode_message(json.dumps({**want, "digest": good + "\n"}))


@pytest.mark.parametrize("model,top", [
    ({"num_kv_heads": 2 ** 40}, {}),  # heads_for_rank would build a 2**40-element tuple: MemoryError
    ({"num_kv_heads": 10 ** 30}, {}),  # OverflowError from the shape arithmetic
    ({"num_layers": 2 ** 21}, {}),
    ({}, {"block_size": 2 ** 40}),
    ({}, {"tp_size": 2 ** 40}),
    ({}, {"k_scale": 10 ** 400}),  # an int beyond float range for a float field: OverflowError in isfinite
])
def test_layout_numbers_out_of_range_are_refused_with_a_reason_everywhere(model, top):
    """A layout with a count above ``MAX_DIM`` (2**20) or a number beyond float range is refused with the module's
    own error by every decoder (parameters, want, registration) and by the pair check (a reason, never a raise).
    Before, MemoryError or OverflowError escaped, and 2**24 heads cost seconds and gigabytes per message."""
    import json

    lay = _layout().to_dict()
    bad = {**lay, **top, "model": {**lay["model"], **model}}
    params = TransferParams.make(engine="e", instance_id="i", transports=[TRANSPORT], request_id="r",
                                 block_ids=[1], num_tokens=20, layout=_layout()).to_dict()
    with pytest.raises(ContractError):
        decode_params({**params, "remote_layout": bad})
    with pytest.raises(ContractError):
        decode_message(json.dumps({"type": "want", "req": "r", "block_ids": [1], "layout": bad}))
    with pytest.raises(ContractError):
        decode_registration({"url": "http://h:1", "kv_layout": bad})
    reasons = check_pair(bad, lay)
    assert reasons and reasons[0].startswith("malformed layout descriptor"), reasons
