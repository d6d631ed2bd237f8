"""The hook's compressed parameters: which compression each one gets, and running it.

Under a compressor strategy ("topk:0.01") every parameter the detection step would sync densely is
compressed instead; under a plan, each parameter takes its plan option, and parameters missing from
the plan stay dense (one warning). Compressors that keep no error feedback (fp16, bf16, none) are
fused: all such parameters of a bucket go through one collective. The others run per parameter,
so their error-feedback memory is keyed by the parameter's name and survives bucket rebuilds.
"""

from __future__ import annotations

import logging
import time

import torch

from zensync.hooks.state import ZenSyncState
from zensync.transport import TrafficLog

__all__ = ["COMPRESSED_PREFIX", "compression_for", "sync_compressed"]

logger = logging.getLogger(__name__)

COMPRESSED_PREFIX = "compress:"
"""Schemes of compressed parameters read ``compress:<spec>|<collective scheme>``."""


def compression_for(state: ZenSyncState, name: str) -> str:
    """The scheme string for a parameter that is not synced sparsely this step ("dense" or compressed)."""
    strategy = state.strategy
    if strategy.kind == "compress":
        assert strategy.compressor is not None
        return _key(strategy.compressor, state.config.compressed_scheme)
    option = strategy.plan.compression_for(name) if strategy.plan is not None else None
    if option is None:
        if strategy.plan is not None and not strategy.plan.has(name) and not state._plan_warned:
            logger.warning(
                "zensync: parameter %s (and possibly others) is not in plan %s; synced densely",
                name,
                strategy.text,
            )
            state._plan_warned = True
        return "dense"
    spec, scheme = option
    return _key(spec, scheme)


def _key(spec: str, scheme: str) -> str:
    return f"{COMPRESSED_PREFIX}{spec}|{scheme}"


def _parse(key: str) -> tuple[str, str]:
    spec, scheme = key[len(COMPRESSED_PREFIX) :].rsplit("|", 1)
    return spec, scheme


def sync_compressed(
    state: ZenSyncState,
    out_views: list[torch.Tensor],
    views: list[torch.Tensor],
    schemes: list[str],
    names: list[str],
) -> None:
    """Sync every compressed parameter of a bucket into ``out_views``; record per-parameter statistics."""
    groups: dict[str, list[int]] = {}
    for i, scheme in enumerate(schemes):
        if scheme.startswith(COMPRESSED_PREFIX):
            groups.setdefault(scheme, []).append(i)
    for key, members in groups.items():
        spec, scheme = _parse(key)
        sync = state.compressed_sync(spec, scheme)
        if sync.error_feedback:
            for i in members:
                _run(state, key, [names[i]], [views[i]], [out_views[i]], names[i])
        else:
            _run(state, key, [names[i] for i in members], [views[i] for i in members], [out_views[i] for i in members])


def _run(
    state: ZenSyncState,
    key: str,
    names: list[str],
    views: list[torch.Tensor],
    outs: list[torch.Tensor],
    ef_name: str = "",
) -> None:
    """One compressed collective over the (fused) ``views``; results written to ``outs``."""
    spec, scheme = _parse(key)
    sync = state.compressed_sync(spec, scheme)
    transport = state.transport
    log = TrafficLog()
    start = time.perf_counter()
    flat = views[0] if len(views) == 1 else torch.cat([v.reshape(-1) for v in views])
    with transport.recording(log):
        summed = sync.sync(
            flat, transport, name=ef_name or f"fused:{names[0]}", step=state.step, hierarchy=state.hierarchy
        )
    offset = 0
    for out, view in zip(outs, views, strict=True):
        out.copy_(summed.reshape(-1)[offset : offset + view.numel()].view(view.shape))
        offset += view.numel()
    elapsed = time.perf_counter() - start
    sent = sum(p.bytes_sent + p.control_bytes_sent for p in log.phases.values())
    total = sum(v.numel() for v in views) or 1
    with state.lock:
        for name, view in zip(names, views, strict=True):
            share = view.numel() / total
            state.current["params"][name] = {
                "scheme": key,
                "density": state.record(name).mean_density,
                "bytes_sent": round(sent * share),
                "measured_s": elapsed * share,
            }
