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
"""Schemes of compressed parameters read ``compress:<spec>|<collective scheme>|<flat or hier>``."""


def compression_for(state: ZenSyncState, name: str) -> str:
    """The scheme string for a parameter that is not synced sparsely this step ("dense" or compressed)."""
    strategy = state.strategy
    if strategy.kind == "compress":
        assert strategy.compressor is not None
        level = "hier" if state.hierarchy is not None else "flat"
        return _key(strategy.compressor, state.config.compressed_scheme, level)
    plan = strategy.plan
    if plan is None or not plan.has(name):
        if plan is not None and not state._plan_warned:
            logger.warning(
                "zensync: parameter %s (and possibly others) is not in plan %s; synced densely", name, strategy.text
            )
            state._plan_warned = True
        return "dense"
    compression = plan.compression_for(name)
    if compression is None:
        return "dense"
    level = plan.option_for(name).level
    if level == "hier2" and not state._hier2_warned:
        logger.warning(
            "zensync: plan %s compresses intra-node phases (hier2); the hook runs them two-level with an "
            "uncompressed intra-node phase",
            strategy.text,
        )
        state._hier2_warned = True
    return _key(compression[0], compression[1], "flat" if level == "flat" else "hier")


def _key(spec: str, scheme: str, level: str) -> str:
    return f"{COMPRESSED_PREFIX}{spec}|{scheme}|{level}"


def _parse(key: str) -> tuple[str, str, str]:
    spec, scheme, level = key[len(COMPRESSED_PREFIX) :].rsplit("|", 2)
    return spec, scheme, level


def sync_compressed(
    state: ZenSyncState,
    out_views: list[torch.Tensor],
    views: list[torch.Tensor],
    schemes: list[str],
    names: list[str],
) -> None:
    """Sync every compressed parameter of a bucket into ``out_views``; record per-parameter statistics.

    Parameters are fused into one collective per (compression, fusion group): under a plan the
    group is the plan's (Cupcake-style fusion); under a compressor spec, compressors without error
    feedback fuse the whole bucket and the others run per parameter. A fused group's error-feedback
    memory is keyed by its alphabetically first parameter's name.
    """
    plan = state.strategy.plan
    parsed: dict[str, tuple[str, str, str]] = {}
    groups: dict[tuple[str, object], list[int]] = {}
    for i, scheme in enumerate(schemes):
        if not scheme.startswith(COMPRESSED_PREFIX):
            continue
        if scheme not in parsed:
            parsed[scheme] = _parse(scheme)
        spec, collective, _ = parsed[scheme]
        if plan is not None:
            fusion: object = plan.group_of(names[i])
        else:
            fusion = names[i] if state.compressed_sync(spec, collective).error_feedback else "bucket"
        groups.setdefault((scheme, fusion), []).append(i)
    for (key, _), members in groups.items():
        # Independent of the order DDP lists a bucket's parameters in (it changes at the rebuild).
        ef_name = names[members[0]] if len(members) == 1 else "fused:" + min(names[i] for i in members)
        _run(
            state,
            key,
            parsed[key],
            [names[i] for i in members],
            [views[i] for i in members],
            [out_views[i] for i in members],
            ef_name,
        )


def _run(
    state: ZenSyncState,
    key: str,
    parsed: tuple[str, str, str],
    names: list[str],
    views: list[torch.Tensor],
    outs: list[torch.Tensor],
    ef_name: str,
) -> None:
    """One compressed collective over the (fused) ``views``; results written to ``outs``."""
    spec, scheme, level = parsed
    sync = state.compressed_sync(spec, scheme)
    transport = state.transport
    levels = state.hierarchy if level == "hier" else None
    log = TrafficLog()
    start = time.perf_counter()
    flat = views[0] if len(views) == 1 else torch.cat([v.reshape(-1) for v in views])
    with transport.recording(log):
        summed = sync.sync(flat, transport, name=ef_name, step=state.step, hierarchy=levels)
    for out, part in zip(outs, summed.reshape(-1).split([v.numel() for v in views]), strict=True):
        out.copy_(part.view(out.shape))
    elapsed = time.perf_counter() - start
    sent = log.total_sent
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
