"""The hook state's checkpoints: validated in full before anything is applied, and agreed across ranks.

``ZenSyncState.load_state_dict`` calls ``parse_state_dict``, which checks every field (types, ranges,
parameter names of this model) and builds the new records without touching the state; only then are
they assigned, all at once. A malformed dict raises ValueError and leaves the state as it was.

Ranks must hold the same engine state (step counter, records' schemes, cost model), or they would
choose different collectives and hang. ``fingerprint`` digests what must agree; the hook compares it
across ranks in one small all-gather at the first step and every ``check_every`` steps
(``ZenSyncState.check_agreement``), and a loaded checkpoint takes effect only at such a step, so a
load on some ranks only, or of different checkpoints, raises the same ValueError on every rank at
that step instead of hanging.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from collections.abc import Collection, Mapping
from typing import Any

from zensync.compress import CompressedSync
from zensync.cost import CostModel
from zensync.hooks.memory import ParamRecord

__all__ = ["STATE_DICT_VERSION", "LoadedState", "fingerprint", "parse_state_dict"]

STATE_DICT_VERSION = 3
_KEYS = ("version", "step", "records", "scheme_correction", "cost_model", "compression")
_KEYS_V2 = _KEYS[:-1]
"""Version 2 had no compression state (its error feedback restarted from zero): still loaded."""
_OPTIONAL = {"buckets", "seed"}
"""DDP's bucket layout of the last step (parameter names per bucket, in order) and Zen's agreed hash
seed: optional, so that version-3 checkpoints saved before them still load."""
_MAX_SEED = 2**63
_MAX_STEP = 2**62
"""Steps beyond this cannot come from training (and would overflow the int64 agreement)."""


@dataclasses.dataclass(frozen=True, slots=True)
class LoadedState:
    """A validated checkpoint, ready to assign."""

    step: int
    records: dict[str, ParamRecord]
    scheme_correction: dict[str, float]
    cost_model: CostModel | None
    compression: dict[tuple[str, str], dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Per (compressor spec, collective): its error-feedback memories and compressor state
    (``CompressedSync.state_dict``), rank-local."""
    buckets: list[list[str]] | None = None
    """DDP's bucket layout when it was saved (``ZenSyncState.bucket_layout``); None: not saved."""
    seed: int | None = None
    """Zen's hash seed when it was saved (the partition of every row: the owners' sums in the same
    order as before); None: not saved, the registration's seed stays."""


def parse_state_dict(state: Any, param_names: Collection[str]) -> LoadedState:
    """Validate ``state`` (from ``ZenSyncState.state_dict``) against a model with ``param_names``.

    Raises:
        ValueError: Naming the first field that is missing, of the wrong type, out of range, or a
            record of a parameter this model does not have.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"zensync hook state_dict must be a dict, got {type(state).__name__}")
    keys = set(state)
    expected = _KEYS_V2 if state.get("version") == 2 else _KEYS
    if keys - _OPTIONAL != set(expected):
        raise ValueError(
            f"zensync hook state_dict keys {sorted(map(str, keys))} are not {sorted(expected)} (saved by another "
            f"version or not a zensync hook state_dict)"
        )
    if state["version"] not in (2, STATE_DICT_VERSION):
        raise ValueError(f"zensync hook state_dict version {state['version']!r} is not {STATE_DICT_VERSION} (or 2)")
    step = _integer(state["step"], "step", _MAX_STEP)
    records_in = state["records"]
    if not isinstance(records_in, Mapping):
        raise ValueError(f"state_dict['records'] must be a dict, got {type(records_in).__name__}")
    unknown = sorted(str(name) for name in records_in if name not in param_names)
    if unknown:
        raise ValueError(
            f"state_dict['records'] names parameters this model does not have: {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''} (a checkpoint of another model?)"
        )
    records = {name: _record(fields, f"records[{name!r}]") for name, fields in records_in.items()}
    correction = _positive_map(state["scheme_correction"], "scheme_correction")
    compression = _compression(state.get("compression", {}))
    buckets = _buckets(state.get("buckets"), param_names)
    seed = None if state.get("seed") is None else _integer(state["seed"], "seed", _MAX_SEED)
    return LoadedState(step, records, correction, _cost_model(state["cost_model"]), compression, buckets, seed)


def _buckets(value: Any, param_names: Collection[str]) -> list[list[str]] | None:
    """``state_dict['buckets']``: None, or lists of this model's parameter names, each name at most once."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(b, list) and all(isinstance(n, str) for n in b) for b in value
    ):
        raise ValueError("state_dict['buckets'] must be a list of lists of parameter names")
    names = [n for b in value for n in b]
    if len(set(names)) != len(names) or not set(names) <= set(param_names):
        raise ValueError("state_dict['buckets'] must name this model's parameters, each at most once")
    return [list(b) for b in value]


def _compression(value: Any) -> dict[tuple[str, str], dict[str, Any]]:
    """``state_dict['compression']``: per "<spec>|<collective>", a ``CompressedSync.state_dict()``."""
    if not isinstance(value, Mapping):
        raise ValueError(f"state_dict['compression'] must be a dict, got {type(value).__name__}")
    out = {}
    for key, part in value.items():
        spec, _, collective = str(key).rpartition("|")
        where = f"state_dict['compression'][{key!r}]"
        if not spec or not isinstance(part, Mapping) or not set(part) <= {"worker", "server", "compressor"}:
            raise ValueError(f"{where} must be keyed '<spec>|<collective>' and hold worker, server, compressor")
        try:
            CompressedSync(spec, collective).load_state_dict(dict(part))  # every field checked on a scratch copy
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        out[(spec, collective)] = dict(part)
    return out


def fingerprint(
    step: int,
    schemes: Mapping[str, str],
    correction: Mapping[str, float],
    model: CostModel | None,
    seed: int | None = None,
) -> int:
    """CRC32 of what every rank must agree on (rank-local measurements are left out)."""
    text = json.dumps(
        {
            "step": step,
            "seed": seed,
            "schemes": sorted(schemes.items()),
            "correction": sorted(correction.items()),
            "model": None if model is None else dataclasses.asdict(model),
        },
        sort_keys=True,
    )
    return zlib.crc32(text.encode())


def _integer(value: Any, field: str, bound: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
        raise ValueError(f"state_dict[{field!r}]={value!r} must be an integer in [0, {bound}]")
    return value


def _number(value: Any, field: str, *, positive: bool = False, allow_inf: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)
    if ok and ((math.isinf(value) and not allow_inf) or value < 0 or (positive and value == 0)):
        ok = False
    if not ok:
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"state_dict {field}={value!r} must be a finite number {bound}")
    return float(value)


def _positive_map(value: Any, field: str) -> dict[str, float]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"state_dict {field} must be a dict of scheme name -> number")
    return {key: _number(v, f"{field}[{key!r}]", positive=True) for key, v in value.items()}


def _record(fields: Any, where: str) -> ParamRecord:
    names = [f.name for f in dataclasses.fields(ParamRecord)]
    if not isinstance(fields, Mapping) or set(fields) != set(names):
        raise ValueError(f"state_dict {where} must be a dict with exactly the keys {names}")
    if not isinstance(fields["scheme"], str) or not fields["scheme"]:
        raise ValueError(f"state_dict {where}['scheme']={fields['scheme']!r} must be a scheme name")
    gamma = fields["gamma"]
    return ParamRecord(
        scheme=fields["scheme"],
        mean_density=_number(fields["mean_density"], f"{where}['mean_density']"),
        gamma=None if gamma is None else _number(gamma, f"{where}['gamma']", positive=True),
        predicted_s=_time_map(fields["predicted_s"], f"{where}['predicted_s']"),
        measured_s=_number(fields["measured_s"], f"{where}['measured_s']"),
        correction=_positive_map(fields["correction"], f"{where}['correction']"),
        bytes_sent=_integer(fields["bytes_sent"], f"{where}['bytes_sent']", _MAX_STEP),
        bytes_recv=_integer(fields["bytes_recv"], f"{where}['bytes_recv']", _MAX_STEP),
        steps=_integer(fields["steps"], f"{where}['steps']", _MAX_STEP),
    )


def _time_map(value: Any, field: str) -> dict[str, float]:
    """Predicted times: >= 0, and inf allowed (a scheme that cannot run is priced at infinity)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"state_dict {field} must be a dict of scheme name -> seconds")
    return {key: _number(v, f"{field}[{key!r}]", allow_inf=True) for key, v in value.items()}


def _cost_model(value: Any) -> CostModel | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) != {"latency_s", "bandwidth_bytes_per_s"}:
        raise ValueError("state_dict cost_model must be None or a dict with latency_s and bandwidth_bytes_per_s")
    return CostModel(
        latency_s=_number(value["latency_s"], "cost_model['latency_s']"),
        # A one-rank group calibrates to infinite bandwidth (nothing crosses a network).
        bandwidth_bytes_per_s=_number(
            value["bandwidth_bytes_per_s"], "cost_model['bandwidth_bytes_per_s']", positive=True, allow_inf=True
        ),
    )
