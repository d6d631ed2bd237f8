"""``python -m zensync.testbed check | cleanup | bench``: probe, clean up, and measure an emulated cluster.

``bench --hosts 4 --rate 1gbit --mbytes 32 --iters 3`` runs the traffic pattern of a ring allreduce of
``--mbytes`` MB (2(n-1) steps of B/n-byte chunks to the next host; stdlib sockets, see ``_sockets``)
and reports achieved bus bandwidth (2(n-1)/n * B / time, the nccl-tests convention) against the
configured rate, and each host's interface tx bytes against the expected 2(n-1)/n * B per iteration.
(A gloo allreduce moves the same bytes; it lives in experiments/emulated_cluster.py because only
zensync.transport may import torch.distributed.)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from zensync.testbed.loopback import make_cluster
from zensync.testbed.netns import available
from zensync.testbed.runs import cleanup_stale, state_dir

__all__ = ["main"]

_BENCH_PORT = 29411
_CPU_BOUND_FRACTION = 0.8
"""Below this fraction of the configured rate the bench warns that it is CPU-bound."""


def _check(_: argparse.Namespace) -> int:
    ok, why = available()
    print(f"emulated cluster available: {ok}\n{why}")
    return 0 if ok else 1


def _cleanup(_: argparse.Namespace) -> int:
    report = cleanup_stale()
    print(report.summary() if report else f"nothing to clean up (run records: {state_dir()})")
    return 0


def _bench(args: argparse.Namespace) -> int:
    nbytes = int(args.mbytes * 1e6)
    with make_cluster(
        args.hosts, rate=args.rate, allow_fallback=not args.no_fallback, offload=not args.no_offload
    ) as cluster:
        ips = ",".join(cluster.host_ip(i) for i in range(args.hosts))
        before = cluster.counters()

        def argv(rank: int) -> list[str]:
            return [
                sys.executable,
                "-m",
                "zensync.testbed._sockets",
                "ring",
                "--rank",
                str(rank),
                "--ips",
                ips,
                "--port",
                str(_BENCH_PORT),
                "--nbytes",
                str(nbytes),
                "--iters",
                str(args.iters),
            ]

        results = cluster.run_workers(argv, timeout_s=args.timeout_s)
        after = cluster.counters()
        rate_bits = getattr(cluster, "rate_bits", None)
    report = _bench_report(args, nbytes, [json.loads(r.stdout) for r in results], before, after, rate_bits)
    print(json.dumps(report, indent=2))
    return 0


def _bench_report(
    args: argparse.Namespace,
    nbytes: int,
    per_rank: list[dict],
    before: list | None,
    after: list | None,
    rate_bits: int | None,
) -> dict[str, object]:
    n = args.hosts
    chunk = per_rank[0]["chunk_bytes"]
    ring_bytes = 2 * (n - 1) * chunk  # per host per iteration: what 2(n-1)/n * B rounds to
    seconds = [max(r["seconds"][k] for r in per_rank) for k in range(args.iters)]
    best = min(seconds)
    report: dict[str, object] = {
        "hosts": n,
        "rate": args.rate,
        "rate_bits": rate_bits,
        "bytes": nbytes,
        "iters": args.iters,
        "seconds_per_iter": seconds,
        "busbw_gbit": ring_bytes * 8 / best / 1e9,
        "expected_bytes_per_host": ring_bytes * args.iters,
    }
    if rate_bits:
        report["busbw_fraction_of_rate"] = fraction = ring_bytes * 8 / best / rate_bits
        if fraction < _CPU_BOUND_FRACTION:
            logging.warning(
                "achieved %.2f of the configured rate: the host CPUs, not the links, are the "
                "bottleneck; lower --rate (or drop --no-offload) for network-bound runs",
                fraction,
            )
    if before is not None and after is not None:
        tx = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        report["wire_tx_bytes_per_host"] = tx
        report["wire_over_expected"] = [t / (ring_bytes * args.iters) for t in tx]
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(prog="python -m zensync.testbed", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="print whether emulated clusters work here, and why not")
    sub.add_parser(
        "cleanup",
        help="remove what runs killed by SIGKILL left (namespaces, their processes, workers, temp dirs); "
        "live runs are not touched",
    )
    bench = sub.add_parser("bench", help="ring traffic between emulated hosts vs the configured rate")
    bench.add_argument("--hosts", type=int, default=4)
    bench.add_argument("--rate", default="1gbit")
    bench.add_argument("--mbytes", type=float, default=32.0, help="allreduce size B in MB (1e6 bytes)")
    bench.add_argument("--iters", type=int, default=3)
    bench.add_argument("--timeout-s", type=float, default=300.0)
    bench.add_argument(
        "--no-offload",
        action="store_true",
        help="MTU-sized frames on the veths: realistic header bytes, but CPU-bound on few cores",
    )
    bench.add_argument("--no-fallback", action="store_true", help="fail instead of falling back to loopback")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return {"check": _check, "cleanup": _cleanup, "bench": _bench}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
