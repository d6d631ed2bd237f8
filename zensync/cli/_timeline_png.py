"""A PNG of a simulated timeline (matplotlib, optional: the [bench] extra)."""

from __future__ import annotations

from zensync.planner import SimResult

__all__ = ["draw_timeline"]

_COLORS = {"forward": "#9ecae1", "backward": "#3182bd", "encode": "#e6550d", "comm": "#31a354", "cpu": "#756bb1"}


def draw_timeline(result: SimResult, path: str, *, title: str = "") -> None:
    """One row per stream, one bar per event, saved as PNG whatever ``path`` ends with.

    Raises:
        ImportError: Without matplotlib.
        OSError: If ``path`` cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = sorted({e.stream for e in result.events}, key=lambda s: (s != "compute", s != "comm", s))
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(streams)))
    for row, stream in enumerate(streams):
        for event in (e for e in result.events if e.stream == stream):
            ax.barh(
                row,
                (event.end_s - event.start_s) * 1e3,
                left=event.start_s * 1e3,
                color=_COLORS.get(event.kind, "#999999"),
                edgecolor="none",
            )
    ax.set_yticks(range(len(streams)), streams)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the iteration")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), loc="upper right", ncols=len(_COLORS), fontsize="small")
    ax.set_title(title or f"iteration {result.iteration_s * 1e3:.2f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
