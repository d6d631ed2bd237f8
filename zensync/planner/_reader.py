"""Reading untrusted plan and profile files: caps checked before parsing, typed fields after.

Every rank reads the plan at ``zensync.register``, so a bad file must stop it with one clear
``ValueError``, never a ``RecursionError`` from ``json`` (it recurses once per nesting level), a
``MemoryError``, or a ``KeyError``/``TypeError`` at the first backward. Steps of ``parse_json``:

1. the text is a ``str`` of at most ``MAX_JSON_CHARS`` characters;
2. its arrays and objects nest at most ``MAX_JSON_DEPTH`` deep (counted on the raw text, strings
   skipped, with a bounded counter: nothing recurses);
3. ``json.loads`` with no NaN/Infinity and no duplicate keys.

``Fields`` (from ``zensync.cost.fields``, which the measured-cost reader shares) then reads each field
of the parsed value, naming the field path, the value (shortened), the bound and the reason in every
message::

    fields = Fields("plan")
    data = fields.mapping(parse_json(text, what="plan"), "", required=("version",), optional=())
    fields.integer(data["version"], "version", low=1, high=1, why="the only plan format")
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

import numpy as np

from zensync.cost.fields import MAX_NAME_CHARS, MAX_NUMEL, NUMEL_WHY, Fields, clip, finite, shorten

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

TENSORS_WHY = "more tensors than any real model has; MAX_TENSORS"
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
