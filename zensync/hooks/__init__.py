"""DDP comm hooks: ``register`` in one line, or ``register_comm_hook(state, zensync_hook)`` as with torch's hooks."""

from __future__ import annotations

from zensync.hooks.config import HookConfig
from zensync.hooks.ddp import register, zensync_hook
from zensync.hooks.decision import Decision, DecisionKind
from zensync.hooks.memory import ParamRecord
from zensync.hooks.state import STRATEGIES, ZenSyncState
from zensync.hooks.steplog import ParamStep, StepRecord

__all__ = [
    "STRATEGIES",
    "Decision",
    "DecisionKind",
    "HookConfig",
    "ParamRecord",
    "ParamStep",
    "StepRecord",
    "ZenSyncState",
    "register",
    "zensync_hook",
]
