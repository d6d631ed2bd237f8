"""Micro-benchmark: every kernel op, numba CPU vs its torch baseline and vs a memory copy, in one run.

Launch (from the repository root)::

    python benchmarks/kernels_cpu.py                       # CPU section; the GPU section too when a GPU is present
    python benchmarks/kernels_cpu.py --numel 10000000 --density 0.01 --topk-numel 25000000 --rounds 7
    python benchmarks/kernels_cpu.py --rows 50000 --row-width 768   # the embedding-gradient hashing case

Hashing runs twice: on the issue's 10M x 1 input and on an embedding gradient (50,000 rows of 768,
1 % of the rows non-zero), the shape Zen syncs.

For each op: the torch baseline the issue names (``torch.topk(x, k, sorted=False)`` for both
selections, ``zeros().index_add_`` for scatter-add, nonzero + argsort bucketing for hashing, the
torch reference for the others), the numba kernel from the main thread (parallel version) and
from a worker thread (serial version), and a copy of the op's input bytes into a preallocated
buffer (``dst.copy_(src)``: the memory bandwidth one pass over the input costs).
Variants are timed round-robin (one call of each per round, medians over rounds) so machine noise
hits them alike. Every numba result is checked equal to the reference first. Writes
``experiments/results/kernels_cpu_<date>.md``.

Targets (issue 5, 2 cores): hashing + bucketing (bucket_nonzero) >= 3x the torch reference on 10M
elements at 1 % density; exact top-k >= 1.5x and sampled-threshold top-k >= 5x torch.topk for
k = 1 % of 25M floats.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import runpy
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numba
import torch

from zensync.kernels import cpu, cpu_codec, cpu_select, reference
from zensync.sync.partition import make_partition

RESULTS = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "results"
_SEED = 0


def environment(rounds: int) -> str:
    """The machine line of a CPU kernel benchmark's report: versions, threads, load, rounds."""
    return (
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numba {numba.__version__} "
        f"({numba.get_num_threads()} threads, layer {numba.config.THREADING_LAYER}), Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; medians of "
        f"{rounds} round-robin rounds"
    )


def _in_thread(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` called from a non-main thread, where numba kernels take their serial path."""

    def call() -> object:
        out: list[object] = []
        worker = threading.Thread(target=lambda: out.append(fn()))
        worker.start()
        worker.join()
        return out[0]

    return call


def _round_robin(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median seconds of each variant, one call of each per round after a warm-up round."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up: JIT compilation or cache load, first-touch of buffers
    for _ in range(rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _equal(a: Any, b: Any) -> bool:
    """Equal; float64 results (sign_encode's sums, added in another order) to float64 rounding."""
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if a.dtype == torch.float64:
        return b.dtype == torch.float64 and torch.allclose(a, b, rtol=1e-12, atol=0)
    return a.dtype == b.dtype and torch.equal(a, b)


def _cases(args: argparse.Namespace) -> list[dict[str, Any]]:
    """(label, baseline, numba function, reference function, call args, bytes of the input)."""
    g = torch.Generator().manual_seed(_SEED)
    n, owners = args.numel, args.owners
    x2d = torch.randn(n, 1, generator=g)
    x2d[torch.rand(n, 1, generator=g) >= args.density] = 0
    # An embedding gradient: rows of args.row_width, args.density of them non-zero.
    table = torch.zeros(args.rows, args.row_width)
    touched = torch.rand(args.rows, generator=g) < args.density
    table[touched] = torch.randn(int(touched.sum()), args.row_width, generator=g)
    table_part = make_partition(args.rows, owners, seed=_SEED)
    part = make_partition(n, owners, seed=_SEED)
    items = reference.nonzero_items(x2d)
    words = reference.bitmap_encode(items, n)
    mags = torch.randn(args.topk_numel, generator=g).abs()
    k = max(1, args.topk_numel // 100)
    sample = mags[torch.randint(0, mags.numel(), (mags.numel() // 100,), generator=g)]
    threshold = float(torch.topk(sample, max(1, sample.numel() // 100)).values.min())
    indices = torch.randint(0, args.topk_numel, (k,), generator=g)
    values = torch.randn(k, generator=g)
    signs = torch.randn(args.topk_numel, generator=g) >= 0
    packed = reference.pack_bits(signs, 1)
    levels = torch.tensor([-1.0, 1.0])
    # The sign family on a bucket-sized gradient: encode, the 4-sender decode, the in-place residual
    # (applied to the same tensor each call: its values drift, its cost does not).
    grad = torch.randn(args.sign_numel, generator=g)
    residual = grad.clone()
    sign_packed = [reference.pack_bits(torch.randn(grad.numel(), generator=g) >= 0, 1) for _ in range(4)]
    sign_levels = torch.tensor([[-0.5, 0.5], [-0.25, 0.75], [-1.0, 1.0], [-0.3, 0.1]])
    decoded = torch.empty_like(grad)

    def case(
        label: str, baseline: Callable, name: str, module: Any, call: tuple, nbytes: int, in_place: bool = False
    ) -> dict[str, Any]:
        return {
            "label": label,
            "baseline": baseline,
            "name": name,
            "module": module,
            "args": call,
            "bytes": nbytes,
            "in_place": in_place,
        }

    return [
        case("bucket_nonzero (hash + bucket)", lambda: reference.bucket_nonzero(x2d, part), "bucket_nonzero", cpu,
             (x2d, part), x2d.nbytes),
        case(f"bucket_nonzero ({args.rows:,} x {args.row_width} rows)",
             lambda: reference.bucket_nonzero(table, table_part), "bucket_nonzero", cpu, (table, table_part),
             table.nbytes),
        case("bitmap_encode", lambda: reference.bitmap_encode(items, n), "bitmap_encode", cpu, (items, n),
             items.nbytes),
        case("bitmap_decode", lambda: reference.bitmap_decode(words, n), "bitmap_decode", cpu, (words, n),
             words.nbytes),
        case(f"topk exact (k={k})", lambda: torch.topk(mags, k, sorted=False), "topk", cpu_select, (mags, k),
             mags.nbytes),
        case(f"topk sampled (k={k})", lambda: torch.topk(mags, k, sorted=False), "sampled_topk", cpu_select,
             (mags, k, threshold), mags.nbytes),
        case(f"scatter_add (k={k})", lambda: torch.zeros(mags.numel()).index_add_(0, indices, values),
             "scatter_add", cpu_codec, (indices, values, mags.numel()), mags.nbytes),
        case("pack_bits (1 bit)", lambda: reference.pack_bits(signs, 1), "pack_bits", cpu_codec, (signs, 1),
             signs.nbytes),
        case("unpack_bits (1 bit, +-1 levels)", lambda: reference.unpack_bits(packed, 1, signs.numel(), levels),
             "unpack_bits", cpu_codec, (packed, 1, signs.numel(), levels), signs.numel() * 4),
        case(f"sign_encode ({grad.numel():,})", lambda: reference.sign_encode(grad), "sign_encode", cpu_codec,
             (grad,), grad.nbytes),
        case("sign_decode_sum (4 senders)", lambda: reference.sign_decode_sum(sign_packed, sign_levels, decoded),
             "sign_decode_sum", cpu_codec, (sign_packed, sign_levels, decoded), grad.nbytes),
        case("sign_residual (in place)", lambda: reference.sign_residual(residual, levels), "sign_residual",
             cpu_codec, (residual, levels), grad.nbytes, in_place=True),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=10_000_000, help="elements of the hashing/bitmap input")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--owners", type=int, default=16)
    parser.add_argument("--rows", type=int, default=50_000, help="rows of the embedding-gradient hashing input")
    parser.add_argument("--row-width", type=int, default=768)
    parser.add_argument("--topk-numel", type=int, default=25_000_000, help="elements of the selection/codec input")
    parser.add_argument("--sign-numel", type=int, default=8_403_978, help="elements of the sign kernels' input")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU section even when a GPU is present")
    args = parser.parse_args()
    header = (
        f"hashing/bitmaps: {args.numel:,} float32 at density {args.density}, {args.owners} owners (the embedding "
        f"case: that density of rows non-zero); selection and codecs: {args.topk_numel:,} float32, k = 1 %. "
        + environment(args.rounds)
    )
    print(header)
    rows = []
    for c in _cases(args):
        numba_fn = getattr(c["module"], c["name"])
        if c["in_place"]:  # each on a copy of the first argument
            copies = [(c["args"][0].clone(), *c["args"][1:]) for _ in range(2)]
            assert _equal(numba_fn(*copies[0]), getattr(reference, c["name"])(*copies[1])), c["label"]
        else:
            assert _equal(numba_fn(*c["args"]), getattr(reference, c["name"])(*c["args"])), c["label"]
        src, dst = torch.ones(c["bytes"], dtype=torch.uint8), torch.zeros(c["bytes"], dtype=torch.uint8)
        variants = {
            "baseline": c["baseline"],
            "numba": lambda fn=numba_fn, a=c["args"]: fn(*a),
            "serial": _in_thread(lambda fn=numba_fn, a=c["args"]: fn(*a)),
            "copy": lambda s=src, d=dst: d.copy_(s),
        }
        t = _round_robin(variants, args.rounds)
        rows.append((c["label"], t))
        print(
            f"{c['label']:<34} baseline {t['baseline'] * 1e3:8.2f} ms  numba {t['numba'] * 1e3:8.2f} ms  serial "
            f"{t['serial'] * 1e3:8.2f} ms  copy {t['copy'] * 1e3:6.2f} ms  baseline/numba "
            f"{t['baseline'] / t['numba']:5.1f}x  numba/copy {t['numba'] / t['copy']:5.1f}x"
        )
    _write(rows, header)
    if torch.cuda.is_available() and not args.no_gpu:
        print("== GPU section: benchmarks/kernels_gpu.py")
        sys.argv = [str(pathlib.Path(__file__).with_name("kernels_gpu.py"))]
        runpy.run_path(sys.argv[0], run_name="__main__")


def _write(rows: list[tuple[str, dict[str, float]]], header: str) -> None:
    lines = [
        f"# Kernel ops on CPU: numba vs torch baselines ({datetime.date.today().isoformat()})",
        "",
        "Command: `python benchmarks/kernels_cpu.py`. " + header + ".",
        "",
        "| op | torch baseline ms | numba ms | numba serial ms | copy of the input ms | baseline / numba | "
        "numba / copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, t in rows:
        lines.append(
            f"| {label} | {t['baseline'] * 1e3:.2f} | {t['numba'] * 1e3:.2f} | {t['serial'] * 1e3:.2f} | "
            f"{t['copy'] * 1e3:.2f} | {t['baseline'] / t['numba']:.1f}x | {t['numba'] / t['copy']:.1f}x |"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"kernels_cpu_{datetime.date.today().isoformat()}.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
