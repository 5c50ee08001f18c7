"""The one place dlmix sets up matplotlib: headless (Agg backend) pyplot and a figure saver.

Used by the simulator's plots (:mod:`dlmix.sim.plots`) and the benchmark report (:mod:`dlmix.bench.report`).
matplotlib is in the ``dev`` extra; :func:`pyplot` raises ImportError with an install hint when it is missing.
This module imports nothing from dlmix: every layer may use it.
"""
from __future__ import annotations

from pathlib import Path

__all__ = ["pyplot", "save"]


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend selected (no display needed).

    Raises ImportError naming the extra to install when matplotlib is absent.
    """
    try:
        import matplotlib
    except ImportError as ex:  # pragma: no cover - matplotlib is in the dev extra
        raise ImportError("plots need matplotlib: pip install 'dlmix[dev]' (or pip install matplotlib)") from ex
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path, dpi: int = 110) -> Path:
    """Lay out ``fig`` tightly, write it to ``path`` (format from the suffix, ``dpi`` dots per inch), close it (frees
    its memory) and return the path."""
    p = Path(path)
    fig.tight_layout()
    fig.savefig(p, dpi=dpi)
    pyplot().close(fig)
    return p
