"""Analytical PD cost model: prefill time, decode step time and KV transfer time per chip, with online calibration.

Formulas (dense decoder with GQA; P params, L layers, h_kv KV heads, d head dim, n_q query heads, b bytes/element):

* KV bytes per token ``kv_bpt = 2 · L · h_kv · d · b`` (K and V for every layer).
* Prefill of N prompt tokens with h already cached (compute-bound; DistServe OSDI'24 §3, Splitwise ISCA'24 §3):
  ``FLOPs = 2·P·(N−h) + 2·L·n_q·d·(N² − h²)`` and ``T_pre = t0 + FLOPs / (MFU · F · chips)``.
* Decode step of a batch of B sequences with Σctx context tokens (memory-bound; Splitwise, Vidur MLSys'24):
  ``T_step = t1 + max((P·b + Σctx·kv_bpt) / (η·BW·chips), 2·P·B / (MFU·F·chips))``.
* KV transfer of n tokens over a link (Mooncake FAST'25 §5, DistServe §4.3):
  ``T_xfer = setup + n · kv_bpt / (η_link · link_BW)``.
* Online refinement: per instance, an EWMA of measured/predicted TTFT and ITL multiplies the predictions
  (Vidur reports < 9 % error for profiled models; the ratio absorbs wrong datasheet figures and engine overheads).

Units: seconds, tokens, bytes, FLOP.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from dlmix.hw.profiles import Catalog, ChipProfile, LinkProfile, load_catalog


@dataclass(frozen=True)
class ModelSpec:
    """Model shape for the cost model.

    Attributes: params (count), layers, q_heads, kv_heads, head_dim, dtype_bytes (2 for BF16/FP16, 1 for FP8 KV).
    """

    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    name: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """``2 · layers · kv_heads · head_dim · dtype_bytes`` bytes (K and V, all layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: Union[str, Path, dict], params: Optional[float] = None) -> "ModelSpec":
        """From a Hugging Face ``config.json`` (path to the file or its folder, or the dict).

        ``params`` defaults to an estimate from the shapes (embeddings + attention + gated MLP), which is within a few
        percent for Llama/Qwen-style models. Raises ValueError when a required key is missing.
        """
        if not isinstance(cfg, dict):
            p = Path(cfg)
            if p.is_dir():
                p = p / "config.json"
            cfg = json.loads(p.read_text())
        try:
            L = int(cfg["num_hidden_layers"])
            H = int(cfg["hidden_size"])
            nq = int(cfg["num_attention_heads"])
        except KeyError as ex:
            raise ValueError(f"config lacks {ex}") from None
        nkv = int(cfg.get("num_key_value_heads", nq))
        d = int(cfg.get("head_dim") or H // nq)
        if params is None:
            inter = int(cfg.get("intermediate_size", 4 * H))
            vocab = int(cfg.get("vocab_size", 32000))
            attn = H * nq * d * 2 + H * nkv * d * 2
            mlp = 3 * H * inter
            emb = vocab * H * (1 if cfg.get("tie_word_embeddings") else 2)
            params = L * (attn + mlp) + emb
        return cls(float(params), L, nq, nkv, d, 2, str(cfg.get("_name_or_path", "")))


#: Shapes of common models (params from the model cards).
PRESETS = {
    "llama-3.1-8b": ModelSpec(8.03e9, 32, 32, 8, 128, 2, "llama-3.1-8b"),
    "qwen2.5-7b": ModelSpec(7.62e9, 28, 28, 4, 128, 2, "qwen2.5-7b"),
    "qwen3-8b": ModelSpec(8.19e9, 36, 32, 8, 128, 2, "qwen3-8b"),
    "smollm2-135m": ModelSpec(1.35e8, 30, 9, 3, 64, 2, "smollm2-135m"),
}


def ewma_ratio(old: float, measured: float, predicted: float, alpha: float = 0.2,
               lo: float = 0.05, hi: float = 50.0) -> float:
    """Calibration step: ``(1−α)·old + α·(measured/predicted)``, clamped to [lo, hi]. Ignores non-positive inputs."""
    if measured <= 0 or predicted <= 0:
        return old
    r = (1 - alpha) * old + alpha * (measured / predicted)
    return lo if r < lo else hi if r > hi else r


class CostModel:
    """Predicts prefill, decode-step and KV-transfer times for a model on catalog chips.

    Args:
        model: :class:`ModelSpec` (or a preset name).
        catalog: :class:`~dlmix.hw.profiles.Catalog` (default: built-in).
        t0: fixed prefill overhead per request, s. t1: fixed decode-step overhead, s.
    """

    def __init__(self, model: Union[ModelSpec, str], catalog: Optional[Catalog] = None,
                 t0: float = 0.005, t1: float = 0.002):
        if isinstance(model, str):
            if model not in PRESETS:
                raise KeyError(f"unknown model preset {model!r}; known: {', '.join(PRESETS)}")
            model = PRESETS[model]
        self.model = model
        self.catalog = catalog or load_catalog()
        self.t0 = t0
        self.t1 = t1
        self._chips: dict = {}
        self._coefs: dict = {}
        m = model
        self._lin = 2.0 * m.params
        self._quad = 2.0 * m.layers * m.q_heads * m.head_dim
        self._wbytes = m.params * m.dtype_bytes
        self.kv_bpt = m.kv_bytes_per_token

    def chip(self, name: str) -> ChipProfile:
        """Catalog lookup, memoised. Raises KeyError."""
        p = self._chips.get(name)
        if p is None:
            p = self._chips[name] = self.catalog.chip(name)
        return p

    def coefs(self, chip: str, num_chips: int = 1) -> tuple:
        """Per-chip constants for hot loops: ``(1/(MFU·F·chips), 1/(η·BW·chips))`` in s/FLOP and s/byte, memoised.

        ``prefill_time = t0 + prefill_flops · c[0]``; ``decode_step_time = t1 + max((P·b + Σctx·kv_bpt) · c[1],
        2·P·B · c[0])``."""
        key = (chip, num_chips)
        c = self._coefs.get(key)
        if c is None:
            p = self.chip(chip)
            c = self._coefs[key] = (1.0 / (p.mfu * p.flops * num_chips), 1.0 / (p.bw_eff * p.mem_bw * num_chips))
        return c

    def prefill_flops(self, n_tokens: int, n_cached: int = 0) -> float:
        """FLOPs to prefill ``n_tokens`` total prompt tokens of which ``n_cached`` hit the prefix cache."""
        u = max(n_tokens - n_cached, 0)
        return self._lin * u + self._quad * max(n_tokens * n_tokens - n_cached * n_cached, 0)

    def prefill_time(self, chip: str, n_tokens: int, n_cached: int = 0, num_chips: int = 1) -> float:
        """Seconds to prefill ``n_tokens`` (``n_cached`` of them cached) on ``num_chips`` of ``chip``
        (compute-bound). 0 uncached tokens still costs ``t0``."""
        p = self.chip(chip)
        return self.t0 + self.prefill_flops(n_tokens, n_cached) / (p.mfu * p.flops * num_chips)

    def decode_step_time(self, chip: str, batch: int, sum_ctx: int, num_chips: int = 1) -> float:
        """Seconds per decode step for ``batch`` sequences with ``sum_ctx`` total context tokens: the slower of the
        memory term (weights + KV read once per step) and the compute term (roofline)."""
        p = self.chip(chip)
        mem = (self._wbytes + sum_ctx * self.kv_bpt) / (p.bw_eff * p.mem_bw * num_chips)
        comp = self._lin * batch / (p.mfu * p.flops * num_chips)
        return self.t1 + (mem if mem > comp else comp)

    def kv_capacity_tokens(self, chip: str, num_chips: int = 1, mem_util: float = 0.9) -> int:
        """Tokens of KV cache that fit: ``(mem_util · memory · chips − weight bytes) / kv_bytes_per_token``
        (vLLM's ``gpu_memory_utilization`` default 0.9; activations ignored). 0 if the weights do not fit."""
        key = ("cap", chip, num_chips, mem_util)
        c = self._coefs.get(key)
        if c is None:
            p = self.chip(chip)
            c = self._coefs[key] = max(int((mem_util * p.mem_gb * 1e9 * num_chips - self._wbytes) / self.kv_bpt), 0)
        return c

    def kv_bytes(self, n_tokens: int) -> int:
        """KV bytes of ``n_tokens`` tokens (``n · kv_bytes_per_token``)."""
        return max(n_tokens, 0) * self.kv_bpt

    def transfer_time(self, n_tokens: int, link: Union[LinkProfile, str, dict, None]) -> float:
        """Seconds to move the KV of ``n_tokens`` over ``link`` (a profile, link name or transport descriptor);
        0 tokens costs 0 (nothing to move)."""
        if n_tokens <= 0:
            return 0.0
        if not isinstance(link, LinkProfile):
            link = self.catalog.link(link)
        return link.setup_ms * 1e-3 + n_tokens * self.kv_bpt / link.bytes_per_s

    def link_between(self, t_p: Optional[dict], t_d: Optional[dict]) -> LinkProfile:
        """Effective link between two instances' transport descriptors: the slower of the two ends, the larger setup."""
        a = self.catalog.link(t_p)
        b = self.catalog.link(t_d)
        if a is b:
            return a
        return LinkProfile(f"{a.name}|{b.name}", min(a.bandwidth_gbps, b.bandwidth_gbps),
                           max(a.setup_ms, b.setup_ms), min(a.eff, b.eff))
