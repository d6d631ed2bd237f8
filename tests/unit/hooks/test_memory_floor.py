"""A sparse parameter's steady-state step allocates, fills and copies nothing of its size.

The DDP hook syncs a bucket in place: its buffer is the output, the detection pass finds the
non-zero rows once and Zen starts from them, divides only their values by the world size and
writes only the union's rows. Measured with the process's peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``): any allocation of the parameter's size that is written, a
copy or a new output, raises it by that size, since blocks this large are fresh mappings.
"""

from __future__ import annotations

import pathlib
import statistics

import pytest
import torch

import zensync
from zensync.hooks import HookConfig, ZenSyncState, zensync_hook

ROWS, DIM = 150_000, 64  # 38 MB of float32, above glibc's largest mmap threshold (32 MiB)
TOUCHED = 300
WORLD = 2
STEPS, WARMUP = 6, 3


def _peak_kib() -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    pathlib.Path("/proc/self/clear_refs").write_text("5")


def _can_reset_peak() -> bool:
    try:
        _reset_peak()
    except OSError:
        return False
    return True


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], buffer: torch.Tensor) -> None:
        self._params, self._buffer = params, buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def is_last(self) -> bool:
        return True


def _grad(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    g = torch.zeros(ROWS, DIM)
    rows = torch.randperm(ROWS, generator=gen)[:TOUCHED]  # distinct: index_put of duplicates picks any
    g[rows] = torch.randint(-3, 4, (TOUCHED, DIM), generator=gen).float()
    return g


@pytest.mark.skipif(not _can_reset_peak(), reason="needs /proc/self/clear_refs (Linux) to reset the peak RSS")
@pytest.mark.parametrize("strategy", ["zen", pytest.param("sparse_ps", marks=pytest.mark.slow)])
def test_sparse_parameter_step_allocates_nothing_of_its_size(strategy: str) -> None:
    emb = torch.nn.Embedding(ROWS, DIM)
    buffers = {(r, s): _grad(r, s).view(-1) for r in range(WORLD) for s in range(STEPS)}
    expected = [sum(_grad(r, s).double() for r in range(WORLD)) / WORLD for s in range(STEPS)]
    growth_kib: list[int] = []
    world = zensync.SimulatedWorld(WORLD, timeout_s=60)

    def body(transport: zensync.Transport) -> list[str]:
        state = ZenSyncState(transport, [("emb.weight", emb.weight)], HookConfig(strategy=strategy))
        state.setup()
        schemes, collectives = [], []
        try:
            for step in range(STEPS):
                buffer = buffers[transport.rank, step]
                if step >= WARMUP:
                    transport.barrier()
                    if transport.rank == 0:
                        _reset_peak()
                    transport.barrier()
                    before = _peak_kib()
                out = zensync_hook(state, _Bucket([emb.weight], buffer)).wait()
                if step >= WARMUP:
                    transport.barrier()
                    growth_kib.append(_peak_kib() - before)
                assert out.data_ptr() == buffer.data_ptr(), "the bucket buffer is the output"
                diff = (out.view(ROWS, DIM).double() - expected[step]).abs()
                assert torch.equal(out.view(ROWS, DIM).double(), expected[step]), (
                    step,
                    float(diff.max()),
                    int((diff.sum(1) > 0).sum()),
                    state.last_step()["params"],
                )
                last = state.last_step()
                assert last is not None
                schemes.append(last["params"]["emb.weight"]["scheme"])
                collectives.append(last["params"]["emb.weight"]["collectives"])
        finally:
            state.close()
        return schemes, collectives

    outcomes = world.run(body)
    schemes = [s for s, _ in outcomes]
    assert all(s == strategy for per_rank in schemes for s in per_rank[WARMUP:]), schemes
    # Zen's per-owner counts ride on the detection gather once Zen synced the parameter the step
    # before: push 1 + pull 2 collectives (its first step: push 2, sizes first).
    for _, collectives in outcomes:
        assert collectives[0] == 4 and set(collectives[1:]) == ({3} if strategy == "zen" else {4}), collectives
    param_kib = ROWS * DIM * 4 // 1024
    # Both ranks' steps together: no step allocates a block of the parameter's size (37,500 KiB:
    # above glibc's largest mmap threshold, such a block is a fresh mapping every step), and the
    # typical step not even a quarter of it. The heaps of the two rank threads grow by 2-14 MiB
    # in a random one of the steps now and then (every revision did so: the sparse_ps case failed
    # 2 of 3 runs against a quarter as the bound of every step), which the median leaves out.
    message = f"peak RSS grew {growth_kib} KiB per step; the parameter is {param_kib}"
    assert max(growth_kib) < param_kib, message
    assert statistics.median(growth_kib) < param_kib // 4, message
