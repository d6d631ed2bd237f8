"""What a ``strategy`` string asks the hook to do: dense, sparse schemes, a compressor, or a plan file.

    "dense"                       plain averaged allreduce (DDP's default)
    "auto"                        per parameter, the cost model's choice among dense and the sparse schemes;
                                  with a step profile (``profile=``), the parameters it does not sync
                                  sparsely take the compressor the planner predicts fastest, if any pays
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
import os
import pathlib
from typing import Any, Literal

from zensync.compress import build, compressor_names, parse_spec
from zensync.planner import AUTO_COMPRESSORS, MAX_JSON_CHARS, AutoChoice, Plan, StepProfile, choose_compression
from zensync.sync import SCHEMES
from zensync.sync.auto import AUTO_CANDIDATES

__all__ = ["AUTO_COMPRESSORS", "Strategy", "auto_compression", "read_step_profile", "resolve_strategy"]


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


def read_step_profile(profile: StepProfile | str | os.PathLike[str]) -> tuple[StepProfile, str]:
    """(the profile, a digest of its JSON): a ``StepProfile``, or a path to the JSON of one.

    Raises:
        ValueError: If the file is missing, too large or not a step profile.
    """
    if isinstance(profile, StepProfile):
        text = profile.to_json()
    else:
        file = pathlib.Path(profile)
        if not file.is_file():
            raise ValueError(f"profile={profile!r}: step profile file not found")
        if file.stat().st_size > MAX_JSON_CHARS:
            raise ValueError(f"profile={profile!r}: the file is larger than MAX_JSON_CHARS={MAX_JSON_CHARS:,}")
        try:
            profile = StepProfile.from_json(file.read_text())
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"profile={str(file)!r}: not a step profile ({exc})") from None
        text = profile.to_json()
    return profile, hashlib.sha256(text.encode()).hexdigest()


def auto_compression(
    strategy: Strategy, profile: StepProfile, compressors: tuple[str, ...], world_size: int, margin: float
) -> tuple[Strategy, AutoChoice]:
    """Strategy "auto" with a step profile: the strategy that compresses with the planner's choice (or ``strategy``
    itself when none pays) and the choice with every candidate's predicted step.

    Candidates are the ``compressors`` the profile measured; the natural-sparsity candidates stay auto's.

    Raises:
        ValueError: If the profile is of another world size, or measured none of ``compressors``.
    """
    if profile.world_size != world_size:
        raise ValueError(
            f"profile: measured on {profile.world_size} ranks, and this group has {world_size}; "
            f"measure it in this group (zensync.profile_group)"
        )
    measured = [spec for spec in compressors if profile.measured(spec)]
    if not measured:
        raise ValueError(
            f"profile: none of auto_compressors={list(compressors)} was measured in it (measured: "
            f"{', '.join(sorted([*profile.compressor_costs, *profile.bucket_costs])) or 'none'}); "
            f"pass them as profile_group(specs=...)"
        )
    choice = choose_compression(profile, measured, margin=margin)
    if choice.spec == "fp32":
        return strategy, choice
    return dataclasses.replace(strategy, kind="compress", compressor=build(choice.spec).spec()), choice
