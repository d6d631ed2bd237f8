"""A whole emulated host replaced (issue 18, item 5): ``experiments/resilience_bench.py`` on 4 network
namespaces at 1 Gbit/s (plus a storage host at 100 Mbit/s) with few steps. Host 3's worker dies in
step KILL_STEP; its namespace is deleted with everything in it and rebuilt (``replace_host``) and its
store is gone (``--max-lag 1``: the newest replicated step is at most one behind the newest saved
one; the disk checkpoint of step 0 is older). Every worker restarts: host 3's shard comes from its
peer's memory, and the run ends with the uninterrupted run's parameters, bit for bit. The bench's
``--floor`` runs are measured too. Needs root (network namespaces); slow tier.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from zensync.testbed import available

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[3] / "experiments"
KILL_STEP, STEPS = 6, 10
_AVAILABLE, _WHY = available() if sys.platform == "linux" else (False, "not Linux")


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(not _AVAILABLE, reason=f"emulated clusters unavailable: {_WHY}")
def test_a_replaced_host_takes_its_shard_from_a_peers_memory(tmp_path: pathlib.Path) -> None:
    argv = [sys.executable, str(EXPERIMENTS / "resilience_bench.py"), "--rounds", "1", "--steps", str(STEPS),
            "--kill-step", str(KILL_STEP), "--max-lag", "1", "--label", "test", "--results-dir", str(tmp_path),
            "--timeout-s", "300", "--floor"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (found,) = tmp_path.glob("resilience_test_*.json")
    results = json.loads(found.read_text())["results"]
    recovery = results["recovery"]
    assert recovery["source"] == "peers" and recovery["fetched_bytes"] > results["shard_bytes"]
    # --max-lag 1: the save of step KILL_STEP - 1 returned once step KILL_STEP - 2 had its replicas
    assert KILL_STEP - 2 <= recovery["step"] <= KILL_STEP - 1
    assert results["max_param_diff"] == 0.0  # the resumed run is the uninterrupted one
    assert results["storage"]["bytes"] > 0 and results["recovery_speedup"] > 1.0
    # --floor: the floor's runs were measured in the same round, beside the checkpoints'
    assert len(results["overhead_floor_rounds"]) == 1 and results["step_s_floor"] > 0.0
    assert results["save_s_floor"] > 0.0 and results["cpu_s_floor"] > 0.0
