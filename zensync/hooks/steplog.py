"""The hook's step log: one ``StepRecord`` per training step, one ``ParamStep`` per synchronized parameter.

``StepLog`` is the only writer: the executor hands it a ``ParamStep`` per parameter and the traffic
of each bucket; ``finish`` closes the step, keeps it in the history and appends it to the JSON-lines
file. ``ZenSyncState.history`` and ``last_step()`` read the records as dicts (``as_dict``), the
same dicts the JSON lines hold. Writers hold the state's lock (async dense buckets complete on a
backend thread).
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any

from zensync.transport import TrafficLog

__all__ = ["ParamStep", "StepLog", "StepRecord"]


@dataclasses.dataclass(slots=True)
class ParamStep:
    """What one parameter's synchronization did in one step (fields a path cannot observe are None)."""

    scheme: str
    """The decision's label (``Decision.label``)."""
    density: float
    """Mean item density over ranks (as last measured)."""
    gamma: float | None = None
    """Sparse schemes: the measured densification gamma_n."""
    bytes_sent: int | None = None
    """Sparse and compressed: payload bytes this rank sent for it (its share of a fused collective)."""
    bytes_recv: int | None = None
    """Sparse: payload bytes received."""
    predicted_s: float | None = None
    """Sparse: the cost model's time for the scheme at the decision."""
    measured_s: float | None = None
    """Sparse and compressed: the measured sync time (its share of a fused collective)."""
    collectives: int | None = None
    """Sparse: backend collectives its scheme ran (``SyncStats.collectives``; the bucket's shared
    detection gather not included)."""
    observes_all: bool = dataclasses.field(default=False, repr=False)
    """The sparse path observes every field: its dicts keep them all, None included (``gamma``
    before any densification was measured, ``predicted_s`` without a prediction)."""

    def as_dict(self) -> dict[str, Any]:
        """The record as a dict: the fields this path observes (dense: scheme and density;
        compressed: also bytes_sent and measured_s; sparse: every field)."""
        return {
            f.name: v
            for f in dataclasses.fields(self)
            if f.name != "observes_all" and ((v := getattr(self, f.name)) is not None or self.observes_all)
        }


@dataclasses.dataclass(slots=True)
class StepRecord:
    """One training step of the hook on this rank."""

    step: int
    comm_time_s: float = 0.0
    """Wall time of the step's bucket syncs (each bucket from its start to its end)."""
    bytes_sent: int = 0
    """Payload plus control bytes sent over all buckets."""
    bytes_recv: int = 0
    params: dict[str, ParamStep] = dataclasses.field(default_factory=dict)
    phases_s: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where the step's sync time went on this rank, summed over buckets: each timed section of
    local work by name (``detect``, which includes its gather's ``wait:detect``; ``divide``,
    ``compress``, ``codec``: an allreduce compressor's own passes, ``decompress``, ``error_feedback``,
    ``finite_check``, ``queued``: a bucket waiting for the lane) and ``wait:<phase>``, the time
    spent inside the collectives of each traffic phase (``dense``, ``detect``, ``compressed``,
    ``agree``...), from the call to completion. Sections overlap where a bucket's work overlaps
    another's collective."""
    step_interval_s: float | None = None
    """Seconds from the previous step's first bucket to this step's: the previous training step
    whole (backward with the sync, optimizer, data, forward) as the hook sees it; None at the first."""
    predicted_step_s: float | None = None
    """With strategy "auto" and a profile: the planner's prediction of that step (``ZenSyncState.auto_choice``)."""
    failed: str | None = None
    """``"<Type>: <message>"`` of the step's first failure on this rank."""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "comm_time_s": self.comm_time_s,
            "bytes_sent": self.bytes_sent,
            "bytes_recv": self.bytes_recv,
            "params": {name: p.as_dict() for name, p in self.params.items()},
            "phases_s": dict(self.phases_s),
        }
        for key in ("step_interval_s", "predicted_step_s"):  # absent when unknown, as a failure
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.failed is not None:
            out["failed"] = self.failed
        return out


class StepLog:
    """The step counter, the open step's record and the finished ones (``history_size`` kept).

    Args:
        history_size: Finished records kept in memory (oldest dropped).
        jsonl_path: Append each finished record as one JSON line here (None: no file).
    """

    __slots__ = ("_history", "current", "jsonl_path", "step")

    def __init__(self, history_size: int, jsonl_path: str | None) -> None:
        self.step = 0
        """Steps finished (the open step's number)."""
        self.current = StepRecord(step=0)
        self._history: collections.deque[StepRecord] = collections.deque(maxlen=history_size)
        self.jsonl_path = jsonl_path

    def note(self, name: str, param: ParamStep) -> None:
        """Record parameter ``name``'s sync in the open step."""
        self.current.params[name] = param

    def note_traffic(self, elapsed_s: float, log: TrafficLog) -> None:
        """Add one bucket's sync time, bytes and phase times (``log``) to the open step."""
        record = self.current
        record.comm_time_s += elapsed_s
        record.bytes_sent += log.total_sent
        record.bytes_recv += log.total_recv
        self.note_phases(log)

    def note_phases(self, log: TrafficLog) -> None:
        """Add ``log``'s timed sections and per-phase collective time to the open step's ``phases_s``."""
        phases = self.current.phases_s
        for name, seconds in log.work_s.items():
            phases[name] = phases.get(name, 0.0) + seconds
        for phase, traffic in log.phases.items():
            key = "wait:" + phase
            phases[key] = phases.get(key, 0.0) + traffic.comm_time_s

    def finish(self, failure: BaseException | None) -> StepRecord:
        """Close the open step (with its failure, if any), keep it, write its JSON line, open the next."""
        record = self.current
        if failure is not None:
            record.failed = f"{type(failure).__name__}: {failure}"
        self._history.append(record)
        if self.jsonl_path is not None:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps(record.as_dict()) + "\n")
        self.step += 1
        self.current = StepRecord(step=self.step)
        return record

    def restart(self, step: int) -> None:
        """Continue at ``step`` with an empty open record (a loaded checkpoint)."""
        self.step = step
        self.current = StepRecord(step=step)

    @property
    def history(self) -> list[StepRecord]:
        """The finished records kept, oldest first."""
        return list(self._history)
