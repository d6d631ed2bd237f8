"""A PNG of ``zensync bench --scan``: latency against message size, per op (matplotlib, optional: the [bench] extra)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["draw_scan"]


def draw_scan(rows: Sequence[dict[str, Any]], path: str, *, title: str = "") -> None:
    """One panel per op, one line per backend, log-log; saved as PNG whatever ``path`` ends with.

    Args:
        rows: The scan's rows (``op``, ``bytes_per_rank``, ``backend``, ``latency_s``).
        path: Where to write the image.
        title: The figure's title.

    Raises:
        ImportError: Without matplotlib.
        OSError: If ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(row["op"] for row in rows))
    backends = list(dict.fromkeys(row["backend"] for row in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for backend in backends:
            mine = sorted(
                (r["bytes_per_rank"], r["latency_s"] * 1e6) for r in rows if (r["op"], r["backend"]) == (op, backend)
            )
            ax.plot([m[0] for m in mine], [m[1] for m in mine], marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("latency (us), slowest rank's median")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
