"""One rank of experiments/simulate_validation.py, inside one emulated host: calibration or measurement.

Sibling module of the driver (experiments/ is not a package). Started by the driver as
``python experiments/_validation_worker.py CONFIG.json calibrate|measure OUT_DIR`` on every host,
with torch.distributed's env:// variables, one torch/numba thread (the simulated world's setting).

``calibrate`` (its own data, never the workload's):

1. ring all-reduce of float32 ones at ``allreduce_bytes`` sizes, timed after a barrier;
2. ``all_to_all_single`` with equal blocks, ``all_to_all_bytes`` sent per rank in all;
3. pairs of ranks (r, r xor 1) on one connection: data one way, then both ways at once (an
   exchange, as SparCML's recursive doubling sends), at the all-reduce's larger sizes;
4. zensync's all_gather_v with uneven blocks (rank r's block (0.5 + r / (n - 1)) / n of the
   all-reduce's size: the ring of point-to-point steps the schemes' pulls run on gloo), and with
   equal blocks (1 / n of it each: gloo's own all-gather, which AGsparse's equal-size blocks take;
   on the 2026-12-05 calibration about twice the ring's CPU per byte, 0.97 vs 0.48 ns at 1 Gbit/s
   n = 16, at 0.54-0.91 of its rate);
5. a fixed local job (``_job``: the schemes' kind of work on the workload's shape, other data): its
   thread-CPU seconds on rank 0 alone (the others wait at a barrier), then its wall seconds on every
   rank at once.

Each timing is the max over ranks of one repetition (every rank times from the same barrier), median
over ``reps``. Around each repetition of steps 1-4 every rank also reads its process's CPU seconds
(all threads: gloo's, the transport's, and the kernel's network work done in its system calls), summed
over ranks; rank 0 also reads the whole machine's busy CPU seconds (``machine_cpu``) around each
collective's warm-up and repetitions: the transport CPU the collective cost, with the kernel's network
work that runs outside any process (softirq on an idle core) in it. Writes ``calibrate_rank<r>.json``.

``measure``: for each scheme, the workload's rank-r tensor through ``run_agreed`` (the path
``zensync.simulate.sweep.simulate_step`` runs, same options and seed, so the collectives are the
same): one warm-up step, then ``steps`` timed steps, each after a barrier, between two reads of
eth0's tx counter (``_counters.fenced_tx``), with the process's CPU seconds (all threads), each
phase's time inside its collectives (``SyncStats.phases``) and how busy the machine's cores were
over the timed steps (``/proc/stat``: whether the step is CPU-bound); then one more step through a
``RecordingTransport`` whose calls (sizes, and this process's thread-CPU local work) go into
``<scheme>_rank<r>.json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zensync.simulate.record import RecordingTransport
from zensync.simulate.sweep import ZipfWorkload
from zensync.sync.base import SyncOptions, item_view
from zensync.sync.run import run_agreed
from zensync.transport import Transport, transport_for_group
from zensync.types import SyncStats

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _counters import cpu_seconds, fenced_tx
from collective_latency import _time as barrier_timed

_SUM_RTOL = 1e-5
"""The sum of the result vs the all-reduced sum of the inputs: float32 sums in different orders."""


def _barrier_timed(fn: Callable[[], object], reps: int) -> list[float]:
    """Per rep, this rank's seconds for ``fn`` after a barrier (warm-up call first)."""
    fn()
    return barrier_timed(fn, reps)


def _timed_with_cpu(fn: Callable[[], object], reps: int) -> tuple[list[float], list[float], float]:
    """Per rep, the max over ranks of the seconds for ``fn`` after a barrier, and the sum over ranks of
    the CPU seconds their processes spent in it (all threads, user and system; warm-up call first);
    and the whole machine's busy CPU seconds per call over the warm-up and the reps (``machine_cpu``:
    the kernel's network work that no process is charged for included; barriers too)."""
    cpu: list[float] = []

    def run() -> None:
        before = cpu_seconds()
        fn()
        cpu.append(cpu_seconds() - before)

    dist.barrier()
    machine_before = machine_cpu()[0]
    seconds = _barrier_timed(run, reps)
    dist.barrier()
    machine_s = (machine_cpu()[0] - machine_before) / (reps + 1)
    summed = torch.tensor(cpu[1:], dtype=torch.float64)
    dist.all_reduce(summed)
    return _max_over_ranks(seconds), summed.tolist(), machine_s


def _max_over_ranks(seconds: list[float]) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _job(rows: int, dim: int, reps: int) -> float:
    """The contention job: ``reps`` rounds of the schemes' kind of local work on the workload's shape
    but other data (seed 77): a zero (rows, dim) tensor, 10 % of its rows set, a scan for the non-zero
    rows, a gather of them. Returns a checksum."""
    gen = torch.Generator().manual_seed(77)
    total = 0.0
    for _ in range(reps):
        x = torch.zeros(rows, dim)
        x[torch.randperm(rows, generator=gen)[: rows // 10]] = 1.5
        items = (x != 0).any(1).nonzero().squeeze(1)
        total += float(x.index_select(0, items).sum())
    return total


def _one_way(x: torch.Tensor, y: torch.Tensor, rank: int, partner: int) -> None:
    if rank % 2 == 0:
        dist.send(x, partner)
    else:
        dist.recv(y, partner)


def _exchange(x: torch.Tensor, y: torch.Tensor, partner: int) -> None:
    ops = [dist.P2POp(dist.isend, x, peer=partner), dist.P2POp(dist.irecv, y, peer=partner)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def calibrate(config: dict[str, Any], out: pathlib.Path) -> None:
    """Steps 1-5 of the module docstring."""
    n, rank, reps = dist.get_world_size(), dist.get_rank(), config["reps"]
    result: dict[str, Any] = {"rank": rank}
    # Step 1: ring all-reduce (gloo's allreduce on CPU tensors).
    allreduce, cpu, machine = {}, {}, {}

    def timed(key: str, fn: Callable[[], object]) -> list[float]:
        seconds, cpu[key], machine[key] = _timed_with_cpu(fn, reps)
        return seconds

    for nbytes in config["allreduce_bytes"]:
        x = torch.ones(nbytes // 4)
        allreduce[nbytes] = timed(f"all_reduce/{nbytes}", lambda x=x: dist.all_reduce(x))
    result["allreduce_s"] = allreduce
    # Step 2: direct all-to-all, equal blocks (what the schemes' all_to_all_v runs on gloo).
    a2a = {}
    for sent_bytes in config["all_to_all_bytes"]:
        block = max(1, sent_bytes // 4 // (n - 1))
        send, recv = torch.ones(block * n), torch.empty(block * n)
        sent = block * 4 * (n - 1)
        a2a[sent] = timed(f"all_to_all_v/{sent}", lambda s=send, r=recv: dist.all_to_all_single(r, s))
    result["all_to_all_s"] = a2a
    # Step 3: one TCP connection, data one way (even rank to odd) vs both ways at once (an exchange).
    partner, one_way, exchange = rank ^ 1, {}, {}
    for nbytes in config["allreduce_bytes"][1:]:
        x, y = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        one_way[nbytes] = _max_over_ranks(_barrier_timed(lambda x=x, y=y: _one_way(x, y, rank, partner), reps))
        exchange[nbytes] = timed(f"send_recv/{nbytes}", lambda x=x, y=y: _exchange(x, y, partner))
    result.update(one_way_s=one_way, exchange_s=exchange)
    # Step 4: zensync's uneven all_gather_v (a ring of point-to-point steps on gloo), and its equal-block
    # one (gloo's own all-gather: another code path, with its own CPU cost).
    transport, gather, equal = transport_for_group(None), {}, {}
    for nbytes in config["allreduce_bytes"]:
        blocks = [max(1, int(nbytes / 4 / n * (0.5 + r / (n - 1)))) for r in range(n)]
        x = torch.ones(blocks[rank])
        total = 4 * sum(blocks)
        gather[total] = timed(f"all_gather_v/{total}", lambda x=x: transport.all_gather_v(x))
        block = max(1, nbytes // 4 // n)
        x = torch.ones(block)
        equal[4 * block * n] = timed(f"all_gather/{4 * block * n}", lambda x=x: transport.all_gather_v(x))
    result.update(all_gather_v_s=gather, all_gather_s=equal, transport_cpu_s=cpu, transport_machine_cpu_s=machine)
    # Step 5: local-work contention: rank 0 alone (thread CPU), then every rank at once (wall).
    job = functools.partial(_job, config["job_rows"], config["job_dim"], config["job_reps"])
    _job(config["job_rows"], config["job_dim"], 1)
    dist.barrier()
    solo_cpu = []
    if rank == 0:
        for _ in range(reps):
            start = time.thread_time()
            job()
            solo_cpu.append(time.thread_time() - start)
    dist.barrier()
    concurrent = _max_over_ranks(_barrier_timed(job, reps))
    result.update(job_solo_thread_cpu_s=solo_cpu, job_concurrent_wall_s=concurrent)
    (out / f"calibrate_rank{rank}.json").write_text(json.dumps(result))


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (/proc/stat; every namespace
    sees the same): busy is all but idle and iowait, kernel network work (softirq) included."""
    ticks = [int(v) for v in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal
    return (total - ticks[3] - ticks[4]) / hz, total / hz


def _step(view: Any, transport: Transport, scheme: str, h0_seed: int) -> tuple[torch.Tensor, SyncStats]:
    """One steady-state step, as ``zensync.simulate.sweep`` runs it."""
    stats = SyncStats()
    options = SyncOptions(h0_seed=h0_seed)
    out = run_agreed(view, transport, scheme=scheme, options=options, h0_seed=h0_seed, stats=stats)
    return out, stats


def _measure_scheme(
    scheme: str, view: Any, transport: Transport, config: dict[str, Any], barrier_tx: int
) -> dict[str, Any]:
    steps, h0_seed, iface = config["steps"], config["h0_seed"], config["iface"] or None
    _step(view, transport, scheme, h0_seed)  # warm-up: kernel compilation, first allocations, connections
    before, machine = fenced_tx(iface), machine_cpu()
    seconds, cpu_s, phase_s, stats = [], [], [], SyncStats()
    for _ in range(steps):
        dist.barrier()
        start, cpu = time.perf_counter(), cpu_seconds()
        out, stats = _step(view, transport, scheme, h0_seed)
        seconds.append(time.perf_counter() - start)
        cpu_s.append(cpu_seconds() - cpu)
        phase_s.append({k: p.comm_time_s for k, p in stats.phases.items()})
    busy_s, total_s = (a - b for a, b in zip(machine_cpu(), machine, strict=True))
    wire = fenced_tx(iface) - before - (steps + 1) * barrier_tx  # steps barriers + the closing fence's
    calls: list[Any] = []
    recording = RecordingTransport(transport, calls)
    _step(view, recording, scheme, h0_seed)
    recording.finish()
    inputs = torch.tensor([float(view.x2d.double().sum())], dtype=torch.float64)
    dist.all_reduce(inputs)
    result_sum, inputs_sum = float(out.double().sum()), float(inputs)
    return {
        "scheme": scheme,
        "seconds": seconds,
        "max_seconds": _max_over_ranks(seconds),
        "process_cpu_s": cpu_s,
        "machine_busy_fraction": busy_s / total_s,
        "phase_comm_s": phase_s,
        "wire_tx_per_step": wire / steps,
        "engine_bytes": sum(p.bytes_sent + p.control_bytes_sent for p in stats.phases.values()),
        "engine_phases": {k: {"sent": p.bytes_sent, "control": p.control_bytes_sent} for k, p in stats.phases.items()},
        "calls": [dataclasses.asdict(c) for c in calls],
        "sum_ok": abs(result_sum - inputs_sum) <= _SUM_RTOL * abs(inputs_sum),
    }


def measure(config: dict[str, Any], out: pathlib.Path) -> None:
    """The module docstring's ``measure``, one file per scheme as each is done."""
    rank = dist.get_rank()
    workload = ZipfWorkload(**config["workload"])
    view = item_view(workload.tensor(rank), "row")
    transport = transport_for_group(None)
    iface = config["iface"] or None
    barrier_tx = -fenced_tx(iface) + fenced_tx(iface)  # one barrier's bytes (the second fence's)
    for scheme in config["schemes"]:
        row = _measure_scheme(scheme, view, transport, config, barrier_tx)
        row["barrier_tx"] = barrier_tx
        (out / f"{scheme}_rank{rank}.json").write_text(json.dumps(row))


def main(argv: list[str]) -> int:
    config_path, role, out = argv
    config = json.loads(pathlib.Path(config_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=config["timeout_s"]))
    (calibrate if role == "calibrate" else measure)(config, pathlib.Path(out))
    dist.barrier()  # every rank's files are written
    # No teardown: gloo's point-to-point thread (the ring all-gather's) can abort the interpreter's
    # exit ("terminate called without an active exception"); the files are all that matters.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
