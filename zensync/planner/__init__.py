"""Espresso-style compression planning: model profiles, a timeline simulator and the plan search.

Never imports the transport layer: planning works offline, with no process group and no GPU.
"""

from __future__ import annotations

from zensync.planner.profile import PROFILE_VERSION, ModelProfile, TensorProfile

__all__ = ["PROFILE_VERSION", "ModelProfile", "TensorProfile"]
