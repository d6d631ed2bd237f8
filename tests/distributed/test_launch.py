"""The gloo launcher itself: a hung or crashed rank fails the launch quickly instead of stalling CI."""

from __future__ import annotations

import time

import pytest

from tests.distributed._launch import LaunchError, launch


def _hang_worker(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(3600)  # never reaches the barrier its peers wait in


def _raise_worker(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        raise RuntimeError("deliberate failure on rank 0")
    dist.barrier()  # blocks: rank 0 never arrives


class TestLaunchHarness:
    @pytest.mark.slow  # ~10 s of waiting for the deadline; the hook fault tests time out ranks in the default run
    def test_hung_rank_is_killed_at_the_deadline(self, tmp_path):
        start = time.monotonic()
        with pytest.raises(LaunchError, match="did not finish within 10 s"):
            launch(_hang_worker, 2, (), tmp_path, timeout_s=10)
        assert time.monotonic() - start < 40

    def test_failed_rank_stops_its_blocked_peers(self, tmp_path):
        start = time.monotonic()
        with pytest.raises(LaunchError, match="deliberate failure on rank 0"):
            launch(_raise_worker, 2, (), tmp_path, peer_grace_s=2)
        assert time.monotonic() - start < 40
