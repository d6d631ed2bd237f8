"""Sync schemes: every lossless way zensync sums a tensor over ranks, one file per algorithm."""

from __future__ import annotations

from zensync.sync import agsparse, auto, dense, omnireduce, sparcml, zen  # noqa: F401 - register schemes
from zensync.sync.base import SyncContext, SyncOptions, SyncScheme, get_scheme, scheme_registry

__all__ = [
    "SCHEMES",
    "SyncContext",
    "SyncOptions",
    "SyncScheme",
    "get_scheme",
    "scheme_registry",
]

SCHEMES = ("auto", "dense", "zen", "agsparse", "sparcml", "sparse_ps", "omnireduce")
"""Every scheme name ``sparse_allreduce`` accepts."""
assert set(SCHEMES) == set(scheme_registry()), "SCHEMES and the registry disagree"
