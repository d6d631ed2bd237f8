"""What a ``strategy`` string asks the hook to do: dense, sparse schemes, a compressor, or a plan file.

    "dense"                       plain averaged allreduce (DDP's default)
    "auto"                        per parameter, the cost model's choice among dense and the sparse schemes
    "zen", "agsparse", ...        that sparse scheme where the cost model predicts it beats dense
    "topk:0.01", "fp16", ...      a compressor spec (``zensync.compress``): parameters that are not
                                  naturally sparse are compressed; naturally sparse ones may still take Zen
    "plan.json"                   a plan from ``zensync plan``: each parameter's option by name

Example::

    resolve_strategy("powersgd:4").compressor  # "powersgd:4"
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from typing import Any, Literal

from zensync.compress import build, compressor_names, parse_spec
from zensync.planner import MAX_JSON_CHARS, Plan
from zensync.sync import SCHEMES
from zensync.sync.auto import AUTO_CANDIDATES

__all__ = ["Strategy", "resolve_strategy"]

Kind = Literal["dense", "sparse", "compress", "plan"]


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
    """A resolved strategy string."""

    text: str
    kind: Kind
    candidates: tuple[str, ...]
    """Schemes weighed per parameter for natural sparsity ("dense" first)."""
    compressor: str | None = None
    """``compress``: the spec applied to parameters that are not synced sparsely."""
    plan: Any = None
    """``plan``: the loaded ``zensync.planner.Plan``."""
    plan_digest: str = ""
    """``plan``: a digest of the plan's content (ranks must load identical plans)."""


def resolve_strategy(text: str) -> Strategy:
    """Parse ``text``; ValueError naming the valid forms when it is none of them."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"strategy={text!r} must be a non-empty string")
    if text == "dense":
        return Strategy(text, "dense", ("dense",))
    if text == "auto":
        return Strategy(text, "sparse", AUTO_CANDIDATES)
    if text in SCHEMES:
        return Strategy(text, "sparse", ("dense", text))
    if text.endswith(".json"):
        return _plan_strategy(text)
    try:
        parse_spec(text)
    except ValueError as exc:
        raise ValueError(
            f"strategy={text!r} is unknown: expected a sync scheme ({', '.join(SCHEMES)}), a compressor spec "
            f"such as 'topk:0.01' or 'powersgd:4' (compressors: {', '.join(compressor_names())}), or a plan "
            f"file path ending in .json ({exc})"
        ) from None
    try:
        compressor = build(text).spec()
    except ValueError as exc:
        raise ValueError(f"strategy={text!r}: {exc}") from None
    return Strategy(text, "compress", ("dense", "zen"), compressor=compressor)


def _plan_strategy(path: str) -> Strategy:
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"strategy={path!r}: plan file not found")
    size = file.stat().st_size
    if size > MAX_JSON_CHARS:  # refused before reading it into memory
        raise ValueError(
            f"strategy={path!r}: the plan file is {size:,} bytes, more than MAX_JSON_CHARS={MAX_JSON_CHARS:,}"
        )
    text = file.read_text()
    plan = Plan.from_json(text)
    return Strategy(path, "plan", ("dense", "zen"), plan=plan, plan_digest=hashlib.sha256(text.encode()).hexdigest())
