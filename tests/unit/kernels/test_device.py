"""``kernels.zeros``: a zero tensor that touches only the pages written to it (CPU, large sizes)."""

from __future__ import annotations

import resource

import pytest
import torch

from zensync import kernels
from zensync.kernels.device import LAZY_ZEROS_MIN_BYTES


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("shape", [(3,), (0, 4), (LAZY_ZEROS_MIN_BYTES // 8, 2), (1000, 700)])
def test_zeros_is_an_ordinary_zero_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    z = kernels.zeros(shape, dtype, torch.device("cpu"))
    assert (z.shape, z.dtype, z.device) == (torch.Size(shape), dtype, torch.device("cpu"))
    assert z.is_contiguous()
    assert torch.equal(z, torch.zeros(shape, dtype=dtype))
    if z.numel():
        z.view(-1)[-1] = 3
        assert z.sum().item() == 3


def _max_rss_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_large_zeros_touch_only_written_pages() -> None:
    # 512 MiB of zeros with one row in 4096 written: the process's peak RSS grows by far less than
    # the tensor (torch.zeros would write, hence fault in, every page).
    rows, dim = 1 << 22, 32
    before = _max_rss_kib()
    z = kernels.zeros((rows, dim), torch.float32, torch.device("cpu"))
    z[::4096] = 1.0
    grown_mib = (_max_rss_kib() - before) / 1024
    assert z.nbytes == 512 << 20
    assert grown_mib < 64, f"peak RSS grew {grown_mib:.0f} MiB for 512 MiB of lazily zeroed memory"
    assert z[::4096].sum().item() == rows // 4096 * dim
    del z
