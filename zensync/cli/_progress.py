"""Progress bars on stderr (tqdm), drawn only when stderr is a terminal: logs and pipes stay quiet."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any

import tqdm  # type: ignore[import-untyped]

__all__ = ["DemoProgress", "bar", "interactive"]


def interactive() -> bool:
    """Whether stderr is a terminal (bars are drawn only then)."""
    return sys.stderr.isatty()


def bar(total: int, desc: str, unit: str = "step") -> Any:
    """A tqdm bar of ``total`` units on stderr; disabled (draws nothing) when stderr is not a terminal."""
    return tqdm.tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not interactive(), dynamic_ncols=True)


class DemoProgress:
    """``say`` and ``on_progress`` of ``zensync.demo.run_demo``: one bar per strategy (steps done, elapsed).

    A status line from ``say`` first closes the open bar, so lines and bars never share a row.
    """

    def __init__(self) -> None:
        self._bar: Any = None
        self._strategy: str | None = None

    def __enter__(self) -> DemoProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def say(self, line: str) -> None:
        """Print a status line on stderr."""
        self.close()
        print(line, file=sys.stderr, flush=True)

    def __call__(self, strategy: str, done: int, total: int) -> None:
        """The workers of ``strategy`` finished ``done`` of ``total`` steps (warm-up included)."""
        if self._bar is None or strategy != self._strategy:
            self.close()
            self._bar, self._strategy = bar(total, strategy), strategy
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Close the open bar, if any."""
        if self._bar is not None:
            self._bar.close()
            self._bar, self._strategy = None, None
