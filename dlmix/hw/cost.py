"""The one analytical cost model (roofline): engine-iteration, prefill, decode-step, KV-transfer times and KV capacity
per chip, used by the router's ``cost`` policy, the simulator's roofline timing and the planner.

Formulas (dense decoder with GQA; P params, L layers, h_kv KV heads, d head dim, n_q query heads, b bytes/element,
F peak FLOP/s, BW peak bytes/s, MFU and η their achievable fractions, ``chips`` the instance's TP×PP):

* KV bytes per token ``kv_bpt = 2 · L · h_kv · d · b`` (K and V for every layer). On an instance of TP size ``t``
  each rank holds ``max(1, h_kv // t)`` KV heads (vLLM ``vllm/config/model.py`` ``ModelConfig.get_num_kv_heads``),
  so a token takes ``kv_bpt(t) = 2 · L · t · max(1, h_kv // t) · d · b`` bytes over all ranks
  (:meth:`ModelSpec.kv_bytes_per_token_tp`): ``kv_bpt`` when ``t`` divides ``h_kv``, ``t / h_kv`` times it when
  ``t > h_kv`` (replicated heads).
* One engine iteration (vLLM V1 continuous batching with chunked prefill; DistServe OSDI'24 §3, Splitwise ISCA'24
  §3, Vidur MLSys'24) computing ``T_p`` new prompt tokens in chunks ``[a_k, b_k)`` (attention work
  ``Q = Σ (b_k² − a_k²)``) plus ``B`` decode tokens over ``S`` context tokens, :meth:`ChipCost.iteration`::

      compute = (2·P·(T_p + B) + 2·L·n_q·d·Q + 4·L·n_q·d·S) / (MFU · F · chips)
      memory  = (P·b + (S + Σ b_k) · kv_bpt(t)) / (η · BW · chips)
      T_iter  = max(compute, memory)                 (+ the engine's fixed per-iteration overhead)

* The router's two estimates are the two ends of that formula:
  prefill of N prompt tokens with h cached (compute-bound: the compute term with ``T_p = N − h``,
  ``Q = N² − h²``, B = S = 0), :meth:`ChipCost.prefill_time`: ``T_pre = t0 + (2·P·(N−h) + 2·L·n_q·d·(N² − h²)) /
  (MFU·F·chips)``; decode step of B sequences over Σctx tokens (memory-bound; the per-token attention FLOPs, ~2 % of
  the memory term for Llama-3.1-8B on an H100, are left out), :meth:`ChipCost.decode_step_time`:
  ``T_step = t1 + max((P·b + Σctx·kv_bpt(t)) / (η·BW·chips), 2·P·B / (MFU·F·chips))``.
* KV transfer of n tokens over a link (Mooncake FAST'25 §5, DistServe §4.3):
  ``T_xfer = setup + n · kv_bpt / (η_link · link_BW)``.
* KV capacity (vLLM's ``gpu_memory_utilization`` share of memory minus the weights; activations ignored):
  ``mem_util · mem_GB · 1e9 · chips − P·b`` bytes, :func:`kv_capacity_bytes`; in tokens, divided by ``kv_bpt(t)``.
* Online refinement: per instance, an EWMA of measured/predicted TTFT and ITL multiplies the predictions
  (Vidur reports < 9 % error for profiled models; the ratio absorbs wrong datasheet figures and engine overheads).

Every coefficient is public: :class:`ModelSpec` (``flops_per_token``, ``attn_flops_per_token2``, ``weight_bytes``,
``kv_bytes_per_token``) and :class:`ChipCost` (seconds per unit of each term, for one chip type × chip count).

Units: seconds, tokens, bytes, FLOP.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

from dlmix.hw.profiles import Catalog, ChipProfile, LinkProfile, load_catalog


@dataclass(frozen=True)
class ModelSpec:
    """Model shape for the cost model.

    Attributes: params (count), layers, q_heads, kv_heads, head_dim, dtype_bytes (2 for BF16/FP16, 1 for FP8 KV),
    name, max_model_len (the model's context limit in tokens, prompt + output, as vLLM derives it from
    ``config.json``, see :func:`context_limit`; 0 = unknown).
    """

    params: float
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    name: str = ""
    max_model_len: int = 0

    def allowed_tp_sizes(self) -> List[int]:
        """Tensor-parallel sizes whose split of the attention heads vLLM and SGLang accept, ascending.

        A TP size ``t`` is allowed when ``q_heads % t == 0`` (vLLM ``vllm/config/model.py``
        ``ModelConfig.verify_with_parallel_config``: "Total number of attention heads must be divisible by tensor
        parallel size") and the KV heads split or replicate evenly: ``kv_heads % t == 0`` when ``t <= kv_heads``,
        else ``t % kv_heads == 0`` (vLLM ``vllm/model_executor/models/llama.py`` ``LlamaAttention.__init__``, the
        same assertions in SGLang's ``python/sglang/srt/models/llama.py``). The list is finite: ``t`` divides
        ``q_heads``. MLA models (DeepSeek-V2/V3) keep ``kv_heads == q_heads`` in their config, so the rule reduces
        to the attention-heads one, which is theirs. Raises ValueError when a head count is < 1.
        """
        if self.q_heads < 1 or self.kv_heads < 1:
            raise ValueError(f"{self.name or 'model'}: head counts must be >= 1, got {self.q_heads} attention and "
                             f"{self.kv_heads} KV heads")
        return [t for t in range(1, self.q_heads + 1) if self.q_heads % t == 0
                and (self.kv_heads % t == 0 if t <= self.kv_heads else t % self.kv_heads == 0)]

    @property
    def kv_bytes_per_token(self) -> int:
        """``2 · layers · kv_heads · head_dim · dtype_bytes`` bytes (K and V, all layers)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads each of ``tp`` tensor-parallel ranks holds: ``max(1, kv_heads // tp)`` (vLLM
        ``vllm/config/model.py`` ``ModelConfig.get_num_kv_heads``: with ``tp > kv_heads`` every rank still holds one
        head, the heads are replicated). Raises ValueError for ``tp < 1``."""
        if tp < 1:
            raise ValueError(f"TP size must be >= 1, got {tp}")
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token_tp(self, tp: int = 1) -> int:
        """KV bytes one token takes on an instance of TP size ``tp``, all its ranks together:
        ``2 · layers · tp · kv_heads_per_rank(tp) · head_dim · dtype_bytes`` (each rank caches its
        :meth:`kv_heads_per_rank` heads, vLLM ``ModelConfig.get_num_kv_heads``), never below
        :attr:`kv_bytes_per_token`. Equal to it when ``tp`` divides ``kv_heads``; ``tp / kv_heads`` times it when
        ``tp > kv_heads``, as each replica of a head takes memory (and is read) on its own rank."""
        per_rank = 2 * self.layers * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes
        return max(tp * per_rank, self.kv_bytes_per_token)

    @property
    def flops_per_token(self) -> float:
        """``2 · params`` FLOPs per token through the weights (prefill or decode)."""
        return 2.0 * self.params

    @property
    def attn_flops_per_token2(self) -> float:
        """``2 · layers · q_heads · head_dim`` attention FLOPs per unit of ``N² − h²`` (prefill of positions h..N);
        a decode token over ``ctx`` context tokens costs ``2 × this × ctx``."""
        return 2.0 * self.layers * self.q_heads * self.head_dim

    @property
    def weight_bytes(self) -> float:
        """``params · dtype_bytes``: bytes of weights read once per iteration."""
        return self.params * self.dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: Union[str, Path, dict], params: Optional[float] = None) -> "ModelSpec":
        """From a Hugging Face ``config.json`` (path to the file or its folder, or the dict).

        ``params`` defaults to an estimate from the shapes (embeddings + attention + gated MLP), which is within a few
        percent for Llama/Qwen-style models. ``name``: the config's ``_name_or_path``, else (given a path) the
        model folder's name (``org/name`` for a Hugging Face cache snapshot), else ``model_type``.
        ``max_model_len``: :func:`context_limit`. Raises ValueError when a required key is missing, OSError when the
        file cannot be read.
        """
        folder = ""
        if not isinstance(cfg, dict):
            p = Path(cfg)
            if p.is_dir():
                p = p / "config.json"
            cfg = json.loads(p.read_text())
            folder = _folder_name(p.resolve().parent)
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
        name = str(cfg.get("_name_or_path") or folder or cfg.get("model_type") or "")
        return cls(float(params), L, nq, nkv, d, 2, name, context_limit(cfg))


def _folder_name(folder: Path) -> str:
    """A model folder's name; ``org/name`` for a Hugging Face cache snapshot (``models--org--name/snapshots/H``)."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name[len("models--"):].replace("--", "/")
    return folder.name


#: config.json keys vLLM reads a model's length from, smallest wins (vLLM
#: ``vllm/transformers_utils/model_arch_config_convertor.py`` ``derive_max_model_len_and_key``)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
#: RoPE types whose ``factor`` vLLM does not apply again (their max_position_embeddings is already scaled)
_ROPE_PRESCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def context_limit(cfg: dict) -> int:
    """The longest sequence (prompt + output tokens) vLLM serves for this Hugging Face ``config.json`` dict without
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``; 0 when the config names no length.

    vLLM's rule (``vllm/config/model.py`` ``_get_and_verify_max_len`` with
    ``vllm/transformers_utils/model_arch_config_convertor.py`` ``derive_max_model_len_and_key``): the smallest of
    :data:`CONTEXT_KEYS` present (``model_max_length``, when present, replaces it), multiplied by the RoPE scaling
    ``factor`` unless the RoPE type is one whose length is already scaled (``llama3``, ``yarn``, ``longrope``, ...).
    Text settings of a multimodal config (``text_config``) are used when present. Tokens; raises nothing.
    """
    c = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    vals = [(k, c[k]) for k in CONTEXT_KEYS if isinstance(c.get(k), (int, float)) and c[k] > 0]
    if not vals:
        return 0
    n = float(min(v for _, v in vals))
    if isinstance(c.get("model_max_length"), (int, float)) and c["model_max_length"] > 0:
        n = float(c["model_max_length"])
    rope = c.get("rope_scaling") or c.get("rope_parameters")
    if isinstance(rope, dict) and "gemma3" not in str(c.get("model_type", "")):
        kind = rope.get("rope_type") or rope.get("type") or "default"
        factor = rope.get("factor")
        if kind not in _ROPE_PRESCALED and isinstance(factor, (int, float)) and factor > 0:
            n *= factor
    return int(n)


#: Shapes of common models (params from the model cards; context limits from their config.json:
#: ``max_position_embeddings``, Llama-3.1's already scaled by its ``llama3`` RoPE).
PRESETS = {
    "llama-3.1-8b": ModelSpec(8.03e9, 32, 32, 8, 128, 2, "llama-3.1-8b", 131072),
    "qwen2.5-7b": ModelSpec(7.62e9, 28, 28, 4, 128, 2, "qwen2.5-7b", 32768),
    "qwen3-8b": ModelSpec(8.19e9, 36, 32, 8, 128, 2, "qwen3-8b", 40960),
    "smollm2-135m": ModelSpec(1.35e8, 30, 9, 3, 64, 2, "smollm2-135m", 8192),
}


def kv_capacity_bytes(chip: ChipProfile, model: ModelSpec, num_chips: int = 1, mem_util: float = 0.9) -> float:
    """Bytes of KV cache on ``num_chips`` of ``chip``: ``mem_GB · 1e9 · chips · mem_util − weight bytes`` (vLLM's
    ``gpu_memory_utilization`` share of device memory minus the weights; activations ignored). Negative when the
    weights do not fit."""
    return chip.mem_gb * 1e9 * num_chips * mem_util - model.weight_bytes


def kv_tp(chip: ChipProfile, num_chips: int) -> int:
    """Tensor-parallel size of an instance of ``num_chips`` of ``chip`` (over which it splits the KV heads):
    ``num_chips``, but 1 on a CPU (vendor ``generic``): a CPU instance of ``num_chips`` cores is one engine at TP 1.
    The planner's :meth:`dlmix.plan.search.Planner.engine_tp` is this rule."""
    return 1 if chip.vendor == "generic" else num_chips


def _sum_lin(a: float, b: float, lo: int, hi: int) -> float:
    """Σ_{i=lo}^{hi-1} (a + b·i)."""
    n = hi - lo
    if n <= 0:
        return 0.0
    return n * a + b * n * (hi + lo - 1) / 2.0


def _sum_max_lin(a1: float, b1: float, a2: float, b2: float, j: int) -> float:
    """Σ_{i<j} max(a1 + b1·i, a2 + b2·i) in closed form (two lines cross at most once)."""
    if j <= 0:
        return 0.0
    da, db = a1 - a2, b1 - b2
    first_is_1 = da >= 0                      # which line is on top at i = 0
    if db == 0:
        m = j                                 # parallel: the same line stays on top
    else:
        m = min(max(int(math.ceil(-da / db)), 0), j)  # first i where the order may flip
        if m == 0:
            first_is_1 = db > 0
            m = j
    top, other = ((a1, b1), (a2, b2)) if first_is_1 else ((a2, b2), (a1, b1))
    return _sum_lin(top[0], top[1], 0, m) + _sum_lin(other[0], other[1], m, j)


class ChipCost:
    """The roofline of one model on ``num_chips`` of one chip type (module docstring), as public per-unit times.

    Args:
        chip: :class:`ChipProfile`. model: :class:`ModelSpec`. num_chips: chips of the instance (≥ 1; compute and
        bandwidth scale linearly). t0 / t1: fixed prefill / decode-step overheads, s (the router's estimates only;
        :meth:`iteration` has none: the caller adds its engine's per-iteration overhead).

    Attributes (seconds per unit):
        s_per_flop: ``1 / (MFU · F · chips)``. s_per_byte: ``1 / (η · BW · chips)``.
        tok_s: compute per token through the weights, ``2·P · s_per_flop`` (prefill and decode tokens alike).
        attn_s: compute per unit of ``Σ (b² − a²)`` (prefill attention), ``2·L·n_q·d · s_per_flop``.
        ctx_s: compute per context token of a decode token, ``4·L·n_q·d · s_per_flop``.
        weights_s: memory time to read the weights once, ``P·b · s_per_byte``.
        kv_s: memory time per token of KV read, ``kv_bpt · s_per_byte``.
    Other attributes: kv_bpt: KV bytes per token over all the instance's ranks,
    :meth:`ModelSpec.kv_bytes_per_token_tp` of its TP size :func:`kv_tp` (replicated KV heads count on every rank).
    Raises ValueError for ``num_chips < 1``.
    """

    __slots__ = ("chip", "model", "num_chips", "t0", "t1", "s_per_flop", "s_per_byte", "tok_s", "attn_s", "ctx_s",
                 "weights_s", "kv_s", "kv_bpt")

    def __init__(self, chip: ChipProfile, model: ModelSpec, num_chips: int = 1, t0: float = 0.0, t1: float = 0.0):
        if num_chips < 1:
            raise ValueError(f"num_chips must be >= 1, got {num_chips}")
        self.chip = chip
        self.model = model
        self.num_chips = num_chips
        self.t0 = float(t0)
        self.t1 = float(t1)
        f = chip.mfu * chip.flops * num_chips
        bw = chip.bw_eff * chip.mem_bw * num_chips
        self.s_per_flop = 1.0 / f
        self.s_per_byte = 1.0 / bw
        self.tok_s = model.flops_per_token / f
        self.attn_s = model.attn_flops_per_token2 / f
        self.ctx_s = 2.0 * model.attn_flops_per_token2 / f
        self.weights_s = model.weight_bytes / bw
        self.kv_bpt = model.kv_bytes_per_token_tp(kv_tp(chip, num_chips))
        self.kv_s = self.kv_bpt / bw

    def iteration(self, t_prefill: int, quad: float, prefill_end_sum: int, batch: int, sum_ctx: int) -> float:
        """Seconds of one engine iteration without fixed overhead: ``t_prefill`` new prompt tokens whose chunks
        ``[a_k, b_k)`` have attention work ``quad`` = Σ (b_k² − a_k²) and end positions summing to
        ``prefill_end_sum``, plus ``batch`` decode tokens over ``sum_ctx`` context tokens: max(compute, memory)."""
        comp = self.tok_s * (t_prefill + batch) + self.attn_s * quad + self.ctx_s * sum_ctx
        mem = self.weights_s + self.kv_s * (sum_ctx + prefill_end_sum)
        return comp if comp > mem else mem

    def decode_span(self, batch: int, sum_ctx: int, j: int) -> float:
        """Seconds of ``j`` consecutive decode-only iterations of ``batch`` sequences starting from ``sum_ctx``
        context tokens (each adds ``batch`` tokens), without overheads: closed form of
        Σ_{i<j} iteration(0, 0, 0, B, S + i·B) (a sum of the max of two lines)."""
        b = batch
        return _sum_max_lin(self.tok_s * b + self.ctx_s * sum_ctx, self.ctx_s * b,
                            self.weights_s + self.kv_s * sum_ctx, self.kv_s * b, j)

    def prefill_compute(self, tokens: int, sq: float) -> float:
        """Seconds of prefill compute for ``tokens`` uncached prompt tokens with attention work ``sq`` = Σ (N² − h²):
        ``tok_s · tokens + attn_s · sq`` (the compute term of :meth:`iteration`; no overhead)."""
        return self.tok_s * tokens + self.attn_s * sq

    def prefill_time(self, n_tokens: int, n_cached: int = 0) -> float:
        """``t0 +`` :meth:`prefill_compute` of ``n_tokens`` prompt tokens, ``n_cached`` of them cached (clamped to
        [0, n_tokens]); 0 uncached tokens still cost ``t0``."""
        h = n_cached if n_cached > 0 else 0  # conditionals, not min/max: this runs per instance per request
        if h > n_tokens:
            h = n_tokens
        return self.t0 + self.tok_s * (n_tokens - h) + self.attn_s * (n_tokens * n_tokens - h * h)

    def decode_step_time(self, batch: int, sum_ctx: int) -> float:
        """``t1 + max(weights_s + kv_s · sum_ctx, tok_s · batch)``: a decode step of ``batch`` sequences over
        ``sum_ctx`` context tokens (memory term vs compute term of :meth:`iteration`, attention FLOPs left out)."""
        mem = self.weights_s + self.kv_s * sum_ctx
        comp = self.tok_s * batch
        return self.t1 + (mem if mem > comp else comp)

    def kv_capacity_tokens(self, mem_util: float = 0.9) -> int:
        """Tokens of KV cache that fit (:func:`kv_capacity_bytes` / :attr:`kv_bpt`, the instance's bytes per token
        with replicated KV heads counted); 0 if the weights do not fit."""
        return max(int(kv_capacity_bytes(self.chip, self.model, self.num_chips, mem_util) / self.kv_bpt), 0)


def ewma_ratio(old: float, measured: float, predicted: float, alpha: float = 0.2,
               lo: float = 0.05, hi: float = 50.0) -> float:
    """Calibration step: ``(1−α)·old + α·(measured/predicted)``, clamped to [lo, hi]. Ignores non-positive inputs."""
    if measured <= 0 or predicted <= 0:
        return old
    r = (1 - alpha) * old + alpha * (measured / predicted)
    return lo if r < lo else hi if r > hi else r


class CostModel:
    """Predicts prefill, decode-step and KV-transfer times for a model on catalog chips (the router's view).

    Args:
        model: :class:`ModelSpec` (or a preset name).
        catalog: :class:`~dlmix.hw.profiles.Catalog` (default: built-in plus plugins, :func:`load_catalog`).
        t0: fixed prefill overhead per request, s. t1: fixed decode-step overhead, s.

    Per-chip figures come from :meth:`on` (a memoised :class:`ChipCost`); the other methods are shorthands by chip
    name. Raises KeyError for an unknown preset or chip name (naming the known ones).
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
        self.kv_bpt = model.kv_bytes_per_token
        self._on: dict = {}
        self._cap: dict = {}

    def chip(self, name: str) -> ChipProfile:
        """Catalog lookup. Raises KeyError."""
        return self.catalog.chip(name)

    def on(self, chip: str, num_chips: int = 1) -> ChipCost:
        """The :class:`ChipCost` of ``num_chips`` of ``chip`` with this model's ``t0``/``t1``, memoised."""
        key = (chip, num_chips)
        c = self._on.get(key)
        if c is None:
            c = self._on[key] = ChipCost(self.catalog.chip(chip), self.model, num_chips, self.t0, self.t1)
        return c

    def coefs(self, chip: str, num_chips: int = 1) -> tuple:
        """``(s_per_flop, s_per_byte)`` of :meth:`on` (``1/(MFU·F·chips)``, ``1/(η·BW·chips)``), for vectorised
        callers that apply the formulas to arrays."""
        c = self.on(chip, num_chips)
        return c.s_per_flop, c.s_per_byte

    def prefill_flops(self, n_tokens: int, n_cached: int = 0) -> float:
        """FLOPs to prefill ``n_tokens`` total prompt tokens of which ``n_cached`` hit the prefix cache."""
        u = max(n_tokens - n_cached, 0)
        m = self.model
        return m.flops_per_token * u + m.attn_flops_per_token2 * max(n_tokens * n_tokens - n_cached * n_cached, 0)

    def prefill_time(self, chip: str, n_tokens: int, n_cached: int = 0, num_chips: int = 1) -> float:
        """Seconds to prefill ``n_tokens`` (``n_cached`` of them cached) on ``num_chips`` of ``chip``
        (:meth:`ChipCost.prefill_time`)."""
        return self.on(chip, num_chips).prefill_time(n_tokens, n_cached)

    def decode_step_time(self, chip: str, batch: int, sum_ctx: int, num_chips: int = 1) -> float:
        """Seconds per decode step for ``batch`` sequences with ``sum_ctx`` total context tokens
        (:meth:`ChipCost.decode_step_time`)."""
        return self.on(chip, num_chips).decode_step_time(batch, sum_ctx)

    def kv_capacity_tokens(self, chip: str, num_chips: int = 1, mem_util: float = 0.9) -> int:
        """Tokens of KV cache that fit (:meth:`ChipCost.kv_capacity_tokens`), memoised. 0 if the weights do not
        fit."""
        key = (chip, num_chips, mem_util)
        c = self._cap.get(key)
        if c is None:
            c = self._cap[key] = self.on(chip, num_chips).kv_capacity_tokens(mem_util)
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
        return link.transfer_time(n_tokens * self.kv_bpt)

    def link_between(self, t_p: Optional[dict], t_d: Optional[dict]) -> LinkProfile:
        """Effective link between two instances' transport descriptors: the slower of the two ends, the larger setup."""
        a = self.catalog.link(t_p)
        b = self.catalog.link(t_d)
        if a is b:
            return a
        return LinkProfile(f"{a.name}|{b.name}", min(a.bandwidth_gbps, b.bandwidth_gbps),
                           max(a.setup_ms, b.setup_ms), min(a.eff, b.eff))
