"""DDP comm hooks: ``register`` in one line, or ``register_comm_hook(state, zensync_hook)`` as with torch's hooks."""

from __future__ import annotations

from zensync.hooks.config import HookConfig
from zensync.hooks.ddp import register, zensync_hook
from zensync.hooks.decide import ParamRecord
from zensync.hooks.state import STRATEGIES, ZenSyncState

__all__ = ["STRATEGIES", "HookConfig", "ParamRecord", "ZenSyncState", "register", "zensync_hook"]
