"""Reading untrusted plan and profile files: caps checked before parsing, typed fields after.

Every rank reads the plan at ``zensync.register``, so a bad file must stop it with one clear
``ValueError``, never a ``RecursionError`` from ``json`` (it recurses once per nesting level), a
``MemoryError``, or a ``KeyError``/``TypeError`` at the first backward. Steps of ``parse_json``:

1. the text is a ``str`` of at most ``MAX_JSON_CHARS`` characters;
2. its arrays and objects nest at most ``MAX_JSON_DEPTH`` deep (counted on the raw text, strings
   skipped, with a bounded counter: nothing recurses);
3. ``json.loads`` with no NaN/Infinity and no duplicate keys.

``Fields`` then reads each field of the parsed value, naming the field path, the value (shortened),
the bound and the reason in every message::

    fields = Fields("plan")
    data = fields.mapping(parse_json(text, what="plan"), "", required=("version",), optional=())
    fields.integer(data["version"], "version", low=1, high=1, why="the only plan format")
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Collection
from typing import Any, NoReturn

import numpy as np

__all__ = [
    "MAX_JSON_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_NAME_CHARS",
    "MAX_NUMEL",
    "MAX_TENSORS",
    "NUMEL_WHY",
    "TENSORS_WHY",
    "Fields",
    "clip",
    "finite",
    "parse_json",
    "shorten",
]

MAX_JSON_CHARS = 64 * 2**20
"""Longest plan or profile text (64 Mi characters; our writers emit ASCII JSON, so also bytes). A plan
with its embedded profile takes about 260 bytes per tensor (resnet50: 161 tensors, 41 kB):
``MAX_TENSORS`` tensors take about 26 MB, leaving some 400 bytes per tensor for longer names, while
parsing on every rank stays within seconds and a few hundred MB."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects. Plans and ``zensync profile`` bundles nest 5 deep (plan >
profile > tensors > tensor > shape); ``json.loads`` recurses once per level, so without a bound a
file of ``[[[[...`` is a RecursionError on every rank that reads it."""
MAX_TENSORS = 100_000
"""Most tensors in a plan or profile: above any model we know (a 671B-parameter mixture of experts
keeping each expert matrix as its own parameter has about 58 layers x 256 experts x 3 = 45k), low
enough that a file cannot make every rank build millions of objects."""
MAX_NAME_CHARS = 4096
"""Longest string field (names, specs, labels): parameter names are dotted module paths of a few
hundred characters at most, and every error message quotes names."""
MAX_NUMEL = 2**50
"""Most elements in one tensor (4 PiB of float32 gradient): far above any real parameter, and below
2**53, so the planner's float64 sizes and times stay exact integers and never overflow."""

TENSORS_WHY = "more tensors than any real model has; MAX_TENSORS"
NUMEL_WHY = "far more elements than any real parameter has; MAX_NUMEL"
_SHORT_CHARS = 60
"""Values in messages are cut to this many characters (a bad file may hold megabytes in one field)."""
# A bounded repr (a few items per level, two levels): showing a value costs O(1), however large it is.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxlong, _REPR.maxother = 2, _SHORT_CHARS, _SHORT_CHARS, _SHORT_CHARS
_ESCAPE = re.compile(r"\\.", re.DOTALL)
"""A backslash and the character it escapes (outside a string, json.loads stops at the backslash)."""
_STRING = re.compile(r'"[^"]*(?:"|\Z)')
"""A JSON string once escapes are gone, or an unterminated one up to the end (json.loads rejects it)."""
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_MAX_INT_DIGITS = 100
"""Longest integer literal parsed (every integer field is bounded far below 10**100)."""
_DEPTH_CHUNK = 2**20
"""Brackets counted per numpy step (bounds the scan's memory at a few MB whatever the file)."""
_OPEN = np.zeros(256, dtype=np.int64)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1


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


def parse_json(text: object, *, what: str) -> Any:
    """The JSON value of an untrusted ``text`` (steps 1-3 of the module docstring).

    Args:
        text: The file's contents.
        what: What the file is, for messages (``"plan"``, ``"profile"``).

    Returns:
        The parsed value (dicts, lists, str, int, finite float, bool, None).

    Raises:
        ValueError: If ``text`` is not a str, is longer than ``MAX_JSON_CHARS``, nests deeper than
            ``MAX_JSON_DEPTH``, is not valid JSON, holds NaN/Infinity, a non-finite number or an
            integer of over 100 digits, or repeats a key in one object.

    Example::

        parse_json('{"a": [1, 2.5]}', what="plan")  # {'a': [1, 2.5]}
        parse_json("[" * 100_000, what="plan")  # ValueError: plan nests ... above MAX_JSON_DEPTH=32 ...
    """
    # Step 1: type and size.
    if not isinstance(text, str):
        raise ValueError(f"{what} must be JSON text (str), got {type(text).__name__}")
    if len(text) > MAX_JSON_CHARS:
        raise ValueError(
            f"{what} is {len(text):,} characters, more than MAX_JSON_CHARS={MAX_JSON_CHARS:,} (far above any "
            f"real {what}; refused before parsing, which would take several times that memory on every rank)"
        )
    # Step 2: nesting, on the raw text.
    depth = _max_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(
            f"{what} nests arrays/objects at least {depth} deep, above MAX_JSON_DEPTH={MAX_JSON_DEPTH} (plans "
            f"and profiles nest at most 5 deep; the JSON parser recurses once per level)"
        )
    # Step 3: parse, strictly.
    try:
        return json.loads(
            text,
            parse_constant=lambda name: _reject_constant(what, name),
            parse_float=lambda literal: _finite_float(what, literal),
            parse_int=lambda literal: _short_int(what, literal),
            object_pairs_hook=lambda pairs: _unique_keys(what, pairs),
        )
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


def _max_depth(text: str) -> int:
    """Deepest count of open brackets outside strings, stopping once above ``MAX_JSON_DEPTH``.

    Equals ``json.loads``' recursion depth on every prefix it parses before any syntax error, so a text
    within the bound cannot make it recurse deeper.
    """
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", _ESCAPE.sub("", text))).encode("ascii")
    steps = np.frombuffer(brackets, dtype=np.uint8)
    depth = deepest = 0
    for start in range(0, len(steps), _DEPTH_CHUNK):
        running = np.cumsum(_OPEN[steps[start : start + _DEPTH_CHUNK]]) + depth
        deepest = max(deepest, int(running.max()))
        if deepest > MAX_JSON_DEPTH:
            break
        depth = int(running[-1])
    return deepest


def _reject_constant(what: str, name: str) -> NoReturn:
    raise ValueError(f"{what} holds {name}, which is not JSON (RFC 8259) and no valid time, size or count")


def _finite_float(what: str, literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"{what} holds the number {shorten(literal)}, which overflows a float64")
    return value


def _short_int(what: str, literal: str) -> int:
    if len(literal) > _MAX_INT_DIGITS:
        raise ValueError(
            f"{what} holds an integer of {len(literal):,} digits, more than {_MAX_INT_DIGITS} (no field takes one "
            f"that large)"
        )
    return int(literal)


def _unique_keys(what: str, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: set[str] = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(
                f"{what} repeats the key {shorten(key)} in one object (readers disagree on which copy wins)"
            )
        seen.add(key)
    return dict(pairs)


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
