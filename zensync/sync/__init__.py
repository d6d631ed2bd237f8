"""Sync schemes: every lossless way zensync sums a tensor over ranks, one file per algorithm."""

from __future__ import annotations

from zensync.sync import agsparse, auto, dense, omnireduce, sparcml, zen  # noqa: F401 - register schemes
from zensync.sync.base import SyncContext, SyncOptions, SyncScheme, scheme_registry
from zensync.sync.cost import CostModel, TensorShape, independent_union, predict_bytes, predict_time

__all__ = [
    "SCHEMES",
    "CostModel",
    "SyncContext",
    "SyncOptions",
    "SyncScheme",
    "TensorShape",
    "independent_union",
    "predict_bytes",
    "predict_time",
    "scheme_registry",
]

SCHEMES = ("auto", "dense", "zen", "agsparse", "sparcml", "sparse_ps", "omnireduce")
"""Every scheme name ``sparse_allreduce`` accepts."""
assert set(SCHEMES) == set(scheme_registry()), "SCHEMES and the registry disagree"
