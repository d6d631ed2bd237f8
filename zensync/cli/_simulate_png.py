"""A PNG of ``zensync simulate``: step time and payload against world size, per scheme (matplotlib, optional)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["draw_simulation"]


def draw_simulation(rows: Sequence[dict[str, Any]], path: str, *, title: str = "") -> None:
    """Two panels, log-log: the priced step time (ms) and the largest rank's payload (MB) per world size.

    Raises:
        ImportError: Without matplotlib.
        OSError: If ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = list(dict.fromkeys(row["scheme"] for row in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for scheme in schemes:
        mine = sorted((r["ranks"], r["seconds"], r["max_sent_bytes"]) for r in rows if r["scheme"] == scheme)
        left.plot([m[0] for m in mine], [m[1] * 1e3 for m in mine], marker="o", label=scheme)
        right.plot([m[0] for m in mine], [m[2] / 1e6 for m in mine], marker="o", label=scheme)
    for ax, label in ((left, "step time (ms), priced"), (right, "largest rank's payload sent (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    left.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)
