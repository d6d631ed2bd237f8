"""MPITransport under mpiexec (started here: no service assumed) against gloo on the same inputs.

Each test runs ``mpiexec -n N python -m mpi4py _mpi_worker.py CASE DIR`` under a deadline and reads
every rank's results: MPI's collectives equal gloo's (values, dtypes, this rank's traffic), Zen and
every other scheme over MPI equal gloo's and the dense sum, bad input fails every rank with the same
error, and a rank that raises or stalls ends the job within its timeout instead of hanging.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import zensync
from tests.distributed.transport._mpi_inputs import ints

pytest.importorskip("mpi4py")
MPIEXEC = shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")

WORKER = Path(__file__).with_name("_mpi_worker.py")
DEADLINE_S = 120.0
"""A whole mpiexec run: start, both worlds' setup, the case."""


def _mpiexec(case: str, ranks: int, tmp_path: Path, *, deadline_s: float = DEADLINE_S) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py", str(WORKER), case, str(tmp_path)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=deadline_s, check=False)


def _results(case: str, ranks: int, tmp_path: Path) -> list[dict[str, Any]]:
    done = _mpiexec(case, ranks, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), (where, a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_collective_equals_gloo(ranks: int, tmp_path: Path) -> None:
    for rank, result in enumerate(_results("collectives", ranks, tmp_path)):
        # reduce_scatter's own algorithm differs (MPI's native, gloo's ring): the same payload
        # bytes, (n-1)/n of the tensor; control bytes: the size check, plus the ring's step prefixes.
        for label, steps in (("mpi", 0), ("gloo", ranks - 1)):
            sent, recv, control, _, calls = result[label]["traffic"].pop("reduce_scatter:auto")
            assert sent == recv == (24 - 24 // ranks) * 2 and calls == 1, label
            assert control == 16 * (ranks - 1) + 8 * steps, label
        _same(result["mpi"], result["gloo"], f"rank {rank}")
        total = sum(ints(1100 + r, 24, torch.float64) for r in range(ranks)).to(torch.bfloat16)
        assert torch.equal(result["mpi"]["reduce_scatter:auto"], total.tensor_split(ranks)[rank])
        for name, seed, numel, dtype in (("", 1000, 23, torch.float32), (":halving", 1050, 21, torch.int64)):
            total = sum(ints(seed + r, numel, torch.float64) for r in range(ranks)).to(dtype)
            assert torch.equal(result["gloo"][f"reduce_scatter{name}"], total.tensor_split(ranks)[rank])
        assert result["mpi"]["inplace_is_input"] and result["zero_copy"]
        for dtype in (torch.float16, torch.bfloat16, torch.int64):  # against their definition too
            expected = sum(ints(r, 37, torch.float64) for r in range(ranks)).to(dtype)
            assert torch.equal(result["mpi"][f"all_reduce:{dtype}"], expected), dtype
        gathered = [ints(300 + r, 0 if r == 1 else r + 2, torch.int64) for r in range(ranks)]
        _same(result["mpi"]["all_gather_v"], gathered, "all_gather_v")


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mixed_dispatch_over_gloo_and_mpi_equals_gloo(ranks: int, tmp_path: Path) -> None:
    """A fixed table that sends small all-reduces, all-to-alls and point-to-point to MPI and the rest
    to gloo, and the table ``tune`` measured (the same on every rank): every collective, its traffic
    and Zen equal gloo alone."""
    results = _results("mixed", ranks, tmp_path)
    assert len({r["tuned_table"] for r in results}) == 1
    for rank, result in enumerate(results):
        for label in ("fixed", "tuned"):
            for run in (result[label], result["gloo"]):  # the routed backend's own algorithm: test above
                run["traffic"].pop("reduce_scatter:auto", None)
            _same(result[label], result["gloo"], f"rank {rank} {label}")
            zen, dense = result[f"{label}_zen"]
            assert torch.equal(zen.reshape(-1), dense), label
        assert set(result["fixed_routed"]) == {"gloo", "mpi"}, result["fixed_routed"]


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_scheme_over_mpi_equals_gloo_and_the_dense_sum(ranks: int, tmp_path: Path) -> None:
    for result in _results("sparse", ranks, tmp_path):
        for scheme in zensync.SCHEMES:
            assert torch.equal(result[scheme]["mpi"], result[scheme]["gloo"]), scheme
            assert torch.equal(result[scheme]["mpi"], result["reference"]), scheme


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_ddp_hook_over_mpi_equals_the_hook_over_gloo(ranks: int, tmp_path: Path) -> None:
    """``register(ddp, transport="mpi")`` and ``transport="mixed"`` (HOOK_TABLE: both backends in use):
    the same parameters after training as over gloo, up to the
    order in which a backend adds 4 ranks' terms (float32 rounding; fp16's in half precision, as
    test_ddp_compress's FP16_ATOL), the same schemes, every rank alike."""
    results = _results("hook", ranks, tmp_path)
    for result in results:
        for strategy, runs in result.items():
            assert runs["mpi"]["transport"] == "MPITransport" and runs["torch"]["transport"] == "TorchTransport"
            assert runs["mixed"]["transport"] == "MixedTransport"
            assert sum(runs["mixed"]["routed"].values()) > 0, strategy
            atol = 2e-3 if strategy == "fp16" and ranks > 2 else 1e-6
            for label in ("mpi", "mixed"):
                assert runs[label]["schemes"] == runs["torch"]["schemes"], (strategy, label)
                for a, b in zip(runs[label]["params"], runs["torch"]["params"], strict=True):
                    assert torch.allclose(a, b, rtol=0, atol=atol), (strategy, label)
    used = {backend for runs in results[0].values() for backend in runs["mixed"]["routed"]}
    assert used == {"gloo", "mpi"}, used  # the table split the hook's collectives over both
    for strategy in results[0]:
        for a, b in zip(results[0][strategy]["mpi"]["params"], results[-1][strategy]["mpi"]["params"], strict=True):
            assert torch.equal(a, b), strategy


@pytest.mark.slow  # the README's run keeps test_bad_input_raises_the_same_error_on_every_rank
def test_mixed_tables_that_differ_between_ranks_fail_registration_on_every_rank(tmp_path: Path) -> None:
    errors = [result["error"] for result in _results("tables_differ", 2, tmp_path)]
    assert errors[0] == errors[1] and "ranks [1] differ from rank 0 in their hook options" in errors[0], errors


def test_bad_input_raises_the_same_error_on_every_rank(tmp_path: Path) -> None:
    results = _results("bad_input", 2, tmp_path)
    assert results[0]["shape"] == results[1]["shape"] and "shape" in results[0]["shape"].lower()
    for result in results:
        assert "cannot sum torch.bool" in result["dtype"]
        assert torch.equal(result["after"], torch.full((2,), 2.0))


def test_a_rank_that_raises_aborts_the_job(tmp_path: Path) -> None:
    start = time.perf_counter()
    done = _mpiexec("raise", 2, tmp_path, deadline_s=60)
    assert done.returncode != 0
    assert "rank 1 failed on purpose" in done.stderr
    assert time.perf_counter() - start < 60


@pytest.mark.slow  # a stalled job waits out its timeout; the README's run keeps a rank that raises
def test_a_stalled_collective_aborts_the_job_after_its_timeout(tmp_path: Path) -> None:
    start = time.perf_counter()
    done = _mpiexec("stall", 2, tmp_path, deadline_s=60)
    elapsed = time.perf_counter() - start
    assert done.returncode != 0
    assert "all_reduce did not complete within the timeout of 3 s" in done.stderr, done.stderr[-2000:]
    assert elapsed < 60, elapsed


def test_a_job_not_started_by_mpiexec_is_refused_with_how_to_launch() -> None:
    """Outside mpiexec MPI is a world of one: transport="mpi" on rank 1 of 2 names the launch line
    (``register`` raises it on every rank through its agreement)."""
    code = "from zensync.transport import MPITransport; MPITransport.check_world(1, 2)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "rank 0 of 1 in MPI_COMM_WORLD but rank 1 of 2 in the DDP group" in done.stderr, done.stderr[-2000:]
    assert "mpiexec -n 2 python -m mpi4py" in done.stderr


def test_the_hook_refuses_an_unknown_transport() -> None:
    with pytest.raises(ValueError, match="transport='nccl' is not one of torch, mpi"):
        zensync.HookConfig(transport="nccl")


@pytest.mark.slow  # the README's run keeps the mixed dispatch over a given table
def test_zensync_tune_writes_a_table_the_mixed_dispatch_loads(tmp_path: Path) -> None:
    """``mpiexec -n 2 python -m mpi4py -m zensync tune``: rank 0 writes a 2-rank table that names only
    gloo and mpi and gives every measured size a backend, and prints what it measured."""
    out = tmp_path / "tuning.json"
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[3]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "zensync", "tune"]
    command += ["--sizes", "8,4096", "--reps", "2", "-o", str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=DEADLINE_S, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = zensync.transport.TuningTable.from_json(out.read_text())
    assert table.world_size == 2 and table.backends() <= {"gloo", "mpi"}
    for op in ("all_reduce", "all_gather", "broadcast"):
        assert {table.backend_for(op, torch.float32, size) for size in (8, 4096)} <= {"gloo", "mpi"}
    assert "| all_reduce | 8 |" in done.stdout and f"wrote {out}" in done.stdout
