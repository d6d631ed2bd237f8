"""Unit tests of ``zensync.kernels.cuda``'s loader, runnable on any machine (no GPU, no nvcc needed).

The module must import without loading anything, warn exactly once when the extension cannot be
loaded, and then give the reference's results; CPU tensors never trigger the load.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import warnings

import pytest
import torch

from zensync.kernels import cuda, reference
from zensync.sync.partition import make_partition

_OPS = ("bucket_nonzero", "bitmap_encode", "bitmap_decode", "topk", "sampled_topk", "scatter_add", "pack_bits")


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that has not tried yet, so this test sees the first load and its warning."""
    monkeypatch.setattr(cuda, "_LOADER", cuda._Loader())


def _load_warnings(records: list[warnings.WarningMessage]) -> list[str]:
    return [str(r.message) for r in records if "cuda_ext" in str(r.message)]


def test_import_neither_loads_nor_warns() -> None:
    """With warnings as errors (after torch's own import), importing the module succeeds: loading waits for use."""
    code = (
        "import warnings, zensync.kernels; warnings.simplefilter('error'); "
        "import zensync.kernels.cuda as c; assert c._LOADER.module is None and not c._LOADER._done"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_failed_load_warns_once_and_falls_back(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda, "_load", lambda: (None, "forced by the test"))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        assert cuda.available() is False
        assert cuda.available() is False
        assert cuda.unavailable_reason() == "forced by the test"
    messages = _load_warnings(records)
    assert len(messages) == 1, messages
    assert "forced by the test" in messages[0] and cuda.FALLBACK in messages[0]
    assert records[0].category is RuntimeWarning


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch may load the extension")
def test_cpu_torch_is_unavailable_with_reason(fresh_loader: None) -> None:
    with pytest.warns(RuntimeWarning, match="CPU-only build") as records:
        assert not cuda.available()
        assert not cuda.available()
    assert len(_load_warnings(records.list)) == 1
    assert "CPU-only build" in cuda.unavailable_reason()


def test_cpu_tensors_take_the_reference_without_loading(fresh_loader: None) -> None:
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0])
    part = make_partition(4, 2, seed=0, hashed=False)
    x2d = torch.tensor([[0.0], [1.0], [0.0], [2.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda.topk(x, 3).tolist() == [1, 2, 3]
        assert cuda.sampled_topk(x, 3, 2.5).tolist() == [1, 2, 3]
        assert [t.tolist() for t in cuda.bucket_nonzero(x2d, part)] == [[1, 3], [1, 3], [2, 0]]
        assert cuda.bitmap_encode(torch.tensor([0, 33]), 40).tolist() == [1, 2]
        assert cuda.bitmap_decode(torch.tensor([1, 2], dtype=torch.int32), 40).tolist() == [0, 33]
        assert cuda.scatter_add(torch.tensor([2, 0, 2]), torch.tensor([1.0, 2.0, 3.0]), 4).tolist() == [2, 0, 4, 0]
        assert cuda.pack_bits(torch.tensor([3, 1], dtype=torch.uint8), 2).tolist() == [7]
        assert cuda.unpack_bits(torch.tensor([7], dtype=torch.uint8), 2, 2).tolist() == [3, 1]
    assert not cuda._LOADER._done


def test_signatures_match_the_reference() -> None:
    """Same parameters as the reference; bucket_nonzero adds keyword-only hashing knobs after them."""
    for name in (*_OPS, "unpack_bits"):
        ours = list(inspect.signature(getattr(cuda, name)).parameters.values())
        theirs = list(inspect.signature(getattr(reference, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in ours[: len(theirs)]] == [
            (p.name, p.kind, p.default) for p in theirs
        ], name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :]), name


def test_invalid_arguments_raise_like_the_reference() -> None:
    x = torch.ones(4)
    with pytest.raises(ValueError, match="k=-1"):
        cuda.topk(x, -1)
    with pytest.raises(ValueError, match="relax_factor"):
        cuda.sampled_topk(x, 1, 0.5, relax_factor=1.5)
    with pytest.raises(ValueError, match="bits=3"):
        cuda.pack_bits(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="length=-1"):
        cuda.bitmap_decode(torch.zeros(1, dtype=torch.int32), -1)
    with pytest.raises(ValueError, match="parallel_slots"):
        cuda.bucket_nonzero(torch.ones(4, 1), make_partition(4, 2, seed=0), parallel_slots=-1)
