"""MPITransport on CUDA tensors under mpiexec: the same results as on CPU tensors, left on the device.

Two ranks share the one GPU. Each input is produced on the current stream behind a queue of matrix
products, so a staging copy that did not wait for the producer would send stale bytes. Without a
CUDA-aware MPI (the MPICH wheel is not one) the transport stages through pinned host memory; with
``ZENSYNC_MPI_CUDA_AWARE=1`` it hands the device memory to MPI. Run by ``cuda_ext/gpu_check.sh``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("mpi4py")

from tests.distributed.transport._mpi_inputs import ints
from tests.distributed.transport.test_mpi import _results, _same

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"),
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (pip install mpich)"),
]


def test_collectives_on_cuda_tensors_equal_the_cpu_ones(tmp_path: Path) -> None:
    ranks = 2
    results = _results("cuda", ranks, tmp_path)
    for rank, result in enumerate(results):
        assert result["cuda"]["inplace_is_input"]
        _same(result["cuda"], result["cpu"], f"rank {rank}")
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):  # against the definition
            expected = sum(ints(r, 37, torch.float64) for r in range(ranks)).to(dtype)
            assert torch.equal(result["cuda"][f"all_reduce:{dtype}"], expected), dtype
        dense = torch.zeros(300, 4)
        for r in range(ranks):  # the inputs case_cuda drew: the dense sum Zen must equal
            gen = torch.Generator().manual_seed(r)
            rows = torch.randperm(300, generator=gen)[:20]
            dense[rows] += torch.randint(1, 5, (20, 4), generator=gen).float()
        assert torch.equal(result["cuda"]["zen"], dense)
