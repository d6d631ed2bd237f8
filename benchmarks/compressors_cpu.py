"""Micro-benchmark: compress and decompress time of every compressor next to a memory copy, on CPU.

Launch (the two glibc variables make the timings reproducible, see below)::

    MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967295 \\
        python benchmarks/compressors_cpu.py [--threads 1] [--repeats 15] [--out-dir experiments/results]

For float32 tensors of 2**16, 2**20 and 2**22 elements (viewed as square-ish matrices, so PowerSGD
compresses them), it times ``x.clone()`` and then, for each compressor, ``compress`` and ``decompress``
(the median of ``--repeats`` calls after 3 warm-up calls), and reports the input's GB/s and each
time as a multiple of the copy's. Results go to ``<out-dir>/compressors_cpu_<YYYY-MM-DD>.md`` and
``.json`` with the config, torch version, thread count, CPU, glibc malloc variables and date.

CPU torch has no caching allocator: a 16 MiB temporary comes from glibc, which by default may hand
freed memory back to the OS and page-fault it in again on the next call, depending on the history
of allocations. Without the two variables, medians of the same op differed up to 8x between runs
(QSGD decompress at 2**22: 1.7 ms or 15.5 ms); with them (heap only, never trimmed), three runs of
QSGD, TernGrad and 1-bit agreed within 10 %.

Expected at 2**22 (1 thread, the 2-core shared VM, with the two variables), in copies of the same
tensor: fp16/bf16 about 0.6 both ways (they write half the bytes); signsgd/efsignsgd/onebit 5-9 to
compress and about 1.4 to decompress; top-k about 50, DGC about 20 (same output as top-k, 2.5x
faster), random-k about 30 (uniform keys for the whole tensor), QSGD and TernGrad about 20 (their
dither draws), PowerSGD rank 4 about 33; the sparse formats decompress in about half a copy (zero
fill plus a scatter of k values). At 2**20 the copy runs from cache and every ratio is about 2x.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import zensync.compress as compress

SPECS = (
    "none",
    "fp16",
    "bf16",
    "randomk:0.01",
    "topk:0.01",
    "dgc:0.01",
    "qsgd:127,128",
    "terngrad",
    "signsgd",
    "efsignsgd",
    "onebit",
    "powersgd:4",
)
LOG2_SIZES = (16, 20, 22)
_SEED = 0
_NUM_WARMUP = 3
_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_NAME = "bench.weight"


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(_NUM_WARMUP):  # also lets the allocator settle on buffers of this size
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class _Row:
    spec: str
    numel: int
    input_bytes: int
    copy_s: float
    """Median time of ``x.clone()`` of the same tensor, measured in the same run."""
    compress_s: float
    decompress_s: float | None
    payload_bytes: int | None


def _bench_size(log2_numel: int, repeats: int) -> list[_Row]:
    """One row per compressor (plus the copy) for a float32 tensor of 2**log2_numel elements."""
    numel = 2**log2_numel
    shape = (2 ** (log2_numel // 2), 2 ** (log2_numel - log2_numel // 2))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(_SEED))
    input_bytes = numel * x.element_size()
    copy_s = _median_s(x.clone, repeats)
    rows = [_Row("copy (x.clone())", numel, input_bytes, copy_s, copy_s, None, None)]
    for spec in SPECS:
        comp = compress.build(spec)
        compress_s = _median_s(lambda comp=comp: comp.compress(x, name=_NAME, step=1), repeats)
        packed = comp.compress(x, name=_NAME, step=1)
        decompress_s = _median_s(lambda comp=comp, packed=packed: comp.decompress(packed), repeats)
        rows.append(_Row(spec, numel, input_bytes, copy_s, compress_s, decompress_s, packed.nbytes))
    return rows


def _cells(row: _Row, seconds: float | None) -> str:
    """'ms | GB/s of input | x copy' for one measurement (blank when not measured)."""
    if seconds is None:
        return " | | "
    return f"{seconds * 1e3:.3f} | {row.input_bytes / seconds / 1e9:.2f} | {seconds / row.copy_s:.1f}"


def _markdown(config: dict[str, object], rows: list[_Row]) -> str:
    lines = [
        f"# Compressors on CPU, {config['date']}",
        "",
        f"Command: `{config['command']}`",
        "",
        "Config: " + ", ".join(f"{k}={v}" for k, v in config.items() if k not in ("command", "date")),
        "",
        "Times are medians of `repeats` calls after 3 warm-up calls. GB/s = input bytes / time; "
        "x copy = time / time of `x.clone()` of the same tensor, measured in the same run. "
        "Payload = payload bytes / input bytes. `none` returns the input tensor itself (no copy, no work), "
        "so its GB/s is not a bandwidth.",
        "",
        "| numel | compressor | compress ms | GB/s | x copy | decompress ms | GB/s | x copy | payload |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        payload = "" if row.payload_bytes is None else f"{row.payload_bytes / row.input_bytes:.4f}"
        lines.append(
            f"| 2^{row.numel.bit_length() - 1} | {row.spec} | {_cells(row, row.compress_s)} | "
            f"{_cells(row, row.decompress_s)} | {payload} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (torch.set_num_threads)")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per measurement (median reported)")
    parser.add_argument("--out-dir", type=Path, default=Path("experiments/results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    date = datetime.date.today().isoformat()
    config: dict[str, object] = {
        "date": date,
        "command": " ".join(
            [f"{k}={os.environ[k]}" for k in _MALLOC_VARIABLES if k in os.environ]
            + [f"python benchmarks/compressors_cpu.py --threads {args.threads} --repeats {args.repeats}"]
        ),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "warmup_calls": _NUM_WARMUP,
        "dtype": "float32",
        "sizes": [2**p for p in LOG2_SIZES],
        "seed": _SEED,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(v, 2) for v in os.getloadavg()],
        "malloc_env": {k: os.environ.get(k, "unset") for k in _MALLOC_VARIABLES},
    }
    rows = [row for p in LOG2_SIZES for row in _bench_size(p, args.repeats)]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"compressors_cpu_{date}"
    stem.with_suffix(".json").write_text(
        json.dumps({"config": config, "rows": [dataclasses.asdict(r) for r in rows]}, indent=2) + "\n"
    )
    report = _markdown(config, rows)
    stem.with_suffix(".md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
