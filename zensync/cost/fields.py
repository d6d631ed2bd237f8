"""Typed reads of untrusted file fields (plans, profiles, measured costs), with messages that teach.

``Fields`` reads each field of a parsed JSON value, naming the field path, the value (shortened), the
bound and the reason in every message::

    fields = Fields("plan")
    data = fields.mapping({"version": 1}, "", required=("version",), optional=())
    fields.integer(data["version"], "version", low=1, high=1, why="the only plan format")

It lives in ``zensync.cost`` because measured compressor costs are read here; the planner's file
reader (``zensync.planner._reader``) adds the caps checked before parsing and re-uses these reads.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Collection
from typing import Any, NoReturn

__all__ = ["MAX_NAME_CHARS", "MAX_NUMEL", "NUMEL_WHY", "Fields", "clip", "finite", "shorten"]

MAX_NAME_CHARS = 4096
"""Longest string field (names, specs, labels): parameter names are dotted module paths of a few
hundred characters at most, and every error message quotes names."""
MAX_NUMEL = 2**50
"""Most elements in one tensor (4 PiB of float32 gradient): far above any real parameter, and below
2**53, so the planner's float64 sizes and times stay exact integers and never overflow."""

NUMEL_WHY = "far more elements than any real parameter has; MAX_NUMEL"
_SHORT_CHARS = 60
"""Values in messages are cut to this many characters (a bad file may hold megabytes in one field)."""
# A bounded repr (a few items per level, two levels): showing a value costs O(1), however large it is.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 2, _SHORT_CHARS, _SHORT_CHARS, _SHORT_CHARS


def shorten(value: object) -> str:
    """``repr(value)`` cut to ``_SHORT_CHARS`` characters, for messages."""
    return clip(_REPR.repr(value))


def clip(text: str) -> str:
    """``text`` cut to ``_SHORT_CHARS`` characters, for names in messages (JSON keys can be long)."""
    return text if len(text) <= _SHORT_CHARS else f"{text[: _SHORT_CHARS - 3]}..."


def finite(value: object) -> float | None:
    """``value`` as a finite float; None for a bool, a non-number or a value a float64 cannot hold."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond float64
        return None
    return number if math.isfinite(number) else None


class Fields:
    """Typed reads of a parsed file's fields; each failure is a ValueError naming ``what``, the field
    path, the value, the bound and the reason."""

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def fail(self, field: str, value: object, rule: str) -> NoReturn:
        """Raise the ValueError ``<what> field '<field>'=<value>: <rule>``."""
        raise ValueError(f"{self.what} field {clip(field)!r}={shorten(value)}: {rule}")

    def mapping(
        self, value: object, field: str, *, required: Collection[str], optional: Collection[str]
    ) -> dict[str, Any]:
        """``value`` as a JSON object holding every ``required`` key and no key outside ``optional``."""
        where = f"{self.what} field {clip(field)!r}" if field else self.what
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(value).__name__} {shorten(value)}")
        missing = [k for k in required if k not in value]
        if missing:
            raise ValueError(f"{self.what} is missing field(s) {_paths(field, missing)}")
        unknown = sorted(set(value) - set(required) - set(optional))
        if unknown:
            valid = sorted({*required, *optional})
            raise ValueError(
                f"{self.what} has unknown field(s) {_paths(field, unknown)[:5]} (a typo or a newer format?); "
                f"{where} takes {valid}"
            )
        return value

    def array(self, value: object, field: str, *, max_items: int, why: str) -> list[Any]:
        """``value`` as a JSON array of at most ``max_items`` items."""
        if not isinstance(value, list):
            self.fail(field, value, f"must be a JSON array, not {type(value).__name__}")
        if len(value) > max_items:
            self.fail(field, f"<{len(value):,} items>", f"must have at most {max_items:,} items ({why})")
        return value

    def string(self, value: object, field: str, *, non_empty: bool = False) -> str:
        """``value`` as a str of at most ``MAX_NAME_CHARS`` characters (non-empty when ``non_empty``)."""
        if not isinstance(value, str) or (non_empty and not value) or len(value) > MAX_NAME_CHARS:
            least = 1 if non_empty else 0
            self.fail(field, value, f"must be a string of {least} to {MAX_NAME_CHARS:,} characters (MAX_NAME_CHARS)")
        return value

    def boolean(self, value: object, field: str) -> bool:
        """``value`` as a bool (JSON true/false, not 0/1)."""
        if not isinstance(value, bool):
            self.fail(field, value, "must be true or false")
        return value

    def integer(self, value: object, field: str, *, low: int, high: int, why: str) -> int:
        """``value`` as an int in [``low``, ``high``] (not a bool, not a float such as 2.0 or 2.5)."""
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            self.fail(field, value, f"must be an integer in [{low:,}, {high:,}] ({why})")
        return value

    def number(self, value: object, field: str, *, why: str, positive: bool = False) -> float:
        """``value`` as a finite float >= 0 (> 0 when ``positive``); ints are accepted."""
        number = finite(value)
        if number is None or not (number > 0 if positive else number >= 0):
            self.fail(field, value, f"must be a finite number {'> 0' if positive else '>= 0'} ({why})")
        return number


def _paths(parent: str, keys: list[str]) -> list[str]:
    return [clip(f"{parent}.{k}" if parent else k) for k in keys]
