"""Engine-iteration timing for the simulator: roofline from a chip profile, or a linear fit calibrated on measurements.

One engine iteration (vLLM V1 continuous batching with chunked prefill) runs, in one forward pass:

* prefill chunks: chunk ``k`` computes prompt positions ``[a_k, b_k)`` (``T_p = Σ (b_k − a_k)`` new tokens,
  attention work ``Q = Σ (b_k² − a_k²)``);
* ``B`` decode sequences, one token each, over ``S = Σ ctx`` context tokens.

:class:`RooflineTiming` is the cost model's engine-iteration roofline (:meth:`dlmix.hw.cost.ChipCost.iteration`,
DistServe OSDI'24 §3, Splitwise ISCA'24 §3, Vidur MLSys'24) plus a fixed overhead ``t_step`` per iteration
(scheduler, sampling, kernel launches): ``T_iter = t_step + max(compute, memory)``.

:class:`LinearTiming` is the calibratable form (one linear fit per chip and engine of measured iteration
times over the roofline's terms)::

    T_iter = c0 + c_tok·T_p + c_quad·Q + c_seq·B + c_ctx·S

plus ``r0``, a fixed per-request overhead added to TTFT (API server, tokenisation, detokenisation). Its coefficients
come from :func:`dlmix.sim.calibrate.fit` over real measurements (e.g. vLLM CPU, ``dlmix/data/sim_calib_*.json``).
Units: seconds, tokens.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Union

from dlmix.hw.cost import ChipCost, ModelSpec
from dlmix.hw.profiles import ChipProfile


class RooflineTiming:
    """Iteration time from peak figures: :class:`dlmix.hw.cost.ChipCost` plus fixed overheads.

    Args:
        chip: :class:`ChipProfile` (peak FLOP/s, bandwidth, MFU, η). model: :class:`ModelSpec`.
        num_chips: chips per instance (TP); compute and bandwidth scale linearly.
        t_step: fixed overhead per iteration, s. r0: fixed overhead per request added to TTFT, s.
    """

    kind = "roofline"

    def __init__(self, chip: ChipProfile, model: ModelSpec, num_chips: int = 1, t_step: float = 0.002,
                 r0: float = 0.0):
        self.chip = chip
        self.model = model
        self.t_step = float(t_step)
        self.r0 = float(r0)
        self.cost = ChipCost(chip, model, num_chips)

    def iteration(self, t_prefill: int, quad: float, prefill_end_sum: int, batch: int, sum_ctx: int) -> float:
        """Seconds for one iteration: ``t_step +`` :meth:`ChipCost.iteration` (``t_prefill`` new prefill tokens
        with attention work ``quad`` whose chunks end at positions summing to ``prefill_end_sum``, plus ``batch``
        decode tokens over ``sum_ctx``)."""
        return self.t_step + self.cost.iteration(t_prefill, quad, prefill_end_sum, batch, sum_ctx)

    def decode_cum(self, batch: int, sum_ctx: int, j: int) -> float:
        """Total seconds of ``j`` consecutive decode-only iterations of ``batch`` sequences starting from context
        ``sum_ctx``: ``j · t_step +`` :meth:`ChipCost.decode_span`."""
        return j * self.t_step + self.cost.decode_span(batch, sum_ctx, j)

    def describe(self) -> dict:
        """Plain dict of the model's parameters (for reports)."""
        return {"kind": self.kind, "chip": self.chip.name, "t_step": self.t_step, "r0": self.r0}


@dataclass
class LinearTiming:
    """Calibrated linear iteration time (see module docstring). Coefficients in seconds, per token / per token²."""

    c0: float
    c_tok: float
    c_quad: float
    c_seq: float
    c_ctx: float
    r0: float = 0.0
    name: str = "linear"
    source: str = ""

    kind = "linear"

    def iteration(self, t_prefill: int, quad: float, prefill_end_sum: int, batch: int, sum_ctx: int) -> float:
        """As :meth:`RooflineTiming.iteration`."""
        return self.c0 + self.c_tok * t_prefill + self.c_quad * quad + self.c_seq * batch + self.c_ctx * sum_ctx

    def decode_cum(self, batch: int, sum_ctx: int, j: int) -> float:
        """As :meth:`RooflineTiming.decode_cum`: ``j·(c0 + c_seq·B + c_ctx·S) + c_ctx·B·j(j−1)/2``."""
        return j * (self.c0 + self.c_seq * batch + self.c_ctx * sum_ctx) + self.c_ctx * batch * j * (j - 1) / 2.0

    def describe(self) -> dict:
        """Plain dict of the coefficients."""
        d = asdict(self)
        d["kind"] = self.kind
        return d

    @classmethod
    def load(cls, path_or_name: Union[str, Path]) -> "LinearTiming":
        """From a calibration JSON file (``{"coefficients": {...}}``) or a built-in name such as
        ``smollm2_vllm_cpu`` (``dlmix/data/sim_calib_<name>.json``). Raises FileNotFoundError / ValueError."""
        p = _profile_path(path_or_name)
        d = json.loads(p.read_text())
        c = d.get("coefficients", d)
        try:
            return cls(float(c["c0"]), float(c["c_tok"]), float(c["c_quad"]), float(c["c_seq"]), float(c["c_ctx"]),
                       float(c.get("r0", 0.0)), str(d.get("name", p.stem)), str(d.get("source", "")))
        except KeyError as ex:
            raise ValueError(f"{p}: calibration lacks coefficient {ex}") from None


def _profile_path(path_or_name: Union[str, Path]) -> Path:
    """The file of a calibration profile: a path, or a built-in name (``dlmix/data/sim_calib_<name>.json``).
    Raises FileNotFoundError."""
    p = Path(str(path_or_name))
    if not p.exists():
        p = Path(str(resources.files("dlmix").joinpath(f"data/sim_calib_{path_or_name}.json")))
    if not p.exists():
        raise FileNotFoundError(f"calibration profile {path_or_name!r} not found")
    return p


def profile_engine_settings(path_or_name: Union[str, Path]) -> dict:
    """The engine settings a calibration profile was measured with (its ``engine`` entry, e.g. ``block_size``,
    ``max_num_batched_tokens``, ``max_num_seqs``; ``{}`` when it records none). Raises FileNotFoundError."""
    d = json.loads(_profile_path(path_or_name).read_text())
    eng = d.get("engine") if isinstance(d, dict) else None
    return dict(eng) if isinstance(eng, dict) else {}
