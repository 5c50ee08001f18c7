"""Engine-neutral prefill/decode (PD) disaggregation core.

* :mod:`dlmix.pd.contract`: the typed, versioned transfer contract (parameters and control messages).
* :mod:`dlmix.pd.pair`: the one pair check (router registration, consumer per request, producer gate).
* :mod:`dlmix.pd.fingerprint`: the weights identity of a model folder (same string on every engine).
* :mod:`dlmix.pd.registration`: the one builder of the router registration body.
* :mod:`dlmix.pd.producer` / :mod:`dlmix.pd.consumer` / :mod:`dlmix.pd.endpoint`: the pull path (hold, grant,
  extend, release; claim, pull in bounded rounds, convert, report failed blocks). An engine adapter supplies only
  its KV tensors + layout, block ids and lifecycle hooks (:class:`dlmix.pd.endpoint.EngineKV`).

Imports no engine; torch is imported only by the pull path modules.
"""
from .contract import CONTRACT_VERSION, ContractError, TransferParams, decode_message, decode_params, prompt_digest
from .fingerprint import weights_fingerprint
from .pair import check_pair, layout_of
from .registration import decode_registration, registration_body

__all__ = ["CONTRACT_VERSION", "ContractError", "TransferParams", "decode_message", "decode_params", "prompt_digest",
           "check_pair", "layout_of", "weights_fingerprint", "registration_body", "decode_registration"]
