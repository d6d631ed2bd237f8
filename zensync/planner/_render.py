"""ASCII Gantt chart of a simulated iteration (``render_timeline``, re-exported by ``simulator``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the simulator imports this module; the type is only needed for annotations
    from zensync.planner.simulator import SimResult

__all__ = ["render_timeline"]

_GLYPH = {"forward": "F", "backward": "=", "encode": "e", "comm": "#", "cpu": "c"}
_PRIORITY = {"forward": 0, "backward": 0, "comm": 1, "cpu": 1, "encode": 2}


def render_timeline(result: SimResult, width: int = 100) -> str:
    """An ASCII Gantt chart of ``result.events`` and a per-stream summary.

    Each stream is one row of ``width`` cells over [0, iteration]; a cell shows the event covering it
    (``F`` forward, ``=`` backward, ``e`` GPU encode, ``#`` comm, ``c`` CPU work, ``.`` idle). Short
    encode kernels are drawn over backward so they stay visible.

    Args:
        result: A ``simulate`` result with ``record_events=True``.
        width: Cells per row (>= 10).

    Returns:
        The chart and summary, several lines.

    Raises:
        ValueError: If ``width`` is below 10.

    Example::

        print(render_timeline(simulate(profile, cluster, model, strategy), width=80))
    """
    if width < 10:
        raise ValueError(f"render_timeline width={width} must be >= 10 cells")
    total = max(result.iteration_s, 1e-12)
    streams = sorted({e.stream for e in result.events}, key=lambda s: (s != "compute", s != "comm", s))
    lines = [f"iteration {total * 1e3:.3f} ms (1 cell = {total / width * 1e3:.3f} ms)"]
    for stream in streams:
        row = ["."] * width
        mine = sorted((e for e in result.events if e.stream == stream), key=lambda e: _PRIORITY.get(e.kind, 1))
        for event in mine:
            first = min(width - 1, int(event.start_s / total * width))
            last = max(first + 1, min(width, math.ceil(event.end_s / total * width)))
            row[first:last] = _GLYPH.get(event.kind, "?") * (last - first)
        lines.append(f"{stream:>8} |{''.join(row)}|")
    lines.append("")
    for stream in streams:
        busy = sum(e.end_s - e.start_s for e in result.events if e.stream == stream and e.kind != "forward")
        count = sum(1 for e in result.events if e.stream == stream)
        lines.append(f"{stream:>8}: busy {busy * 1e3:9.3f} ms ({busy / total:6.1%}), {count} intervals")
    lines.append(
        f"forward {result.forward_s * 1e3:.3f} ms, backward ends {result.backward_end_s * 1e3:.3f} ms, "
        f"comm busy {result.comm_busy_s * 1e3:.3f} ms, exposed comm {result.exposed_comm_s * 1e3:.3f} ms, "
        f"GPU compression {result.gpu_compress_s * 1e3:.3f} ms, CPU compression {result.cpu_compress_s * 1e3:.3f} ms"
    )
    return "\n".join(lines)
