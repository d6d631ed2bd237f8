"""Cases run under mpiexec by test_mpi.py: ``mpiexec -n N python -m mpi4py _mpi_worker.py CASE OUT_DIR``.

Every rank joins torch.distributed (gloo) from MPI (``init_torch_distributed``), runs the case over
both ``MPITransport`` and the gloo ``TorchTransport`` on the same inputs, and writes what it saw to
OUT_DIR/rank<r>.pt; test_mpi.py compares. Inputs are small integers in float dtypes, so sums are
exact whatever order a backend adds in. Cases that must fail (``raise``, ``stall``) end the job.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch

import zensync
from tests.distributed.hooks.test_ddp_hook import STEPS, _batch, _Net
from tests.distributed.transport._mpi_inputs import ints
from zensync.transport import MixedTransport, TorchTransport, TrafficLog, Transport, TuningTable, launch, run_sync, tune
from zensync.transport.mixed import TuningEntry
from zensync.transport.mpi import MPITransport, init_torch_distributed

SUM_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.float16, torch.bfloat16)


def _battery(t: Transport) -> dict[str, Any]:
    """Every collective of the interface, blocking and not, with this rank's traffic per phase."""
    r, n = t.rank, t.world_size
    out: dict[str, Any] = {}
    log = TrafficLog()
    with t.recording(log):
        for dtype in SUM_DTYPES:
            with t.phase(f"all_reduce:{dtype}"):
                out[f"all_reduce:{dtype}"] = t.all_reduce(ints(r, 37, dtype))
        with t.phase("all_reduce:empty"):
            out["all_reduce:empty"] = t.all_reduce(torch.empty(0))
        x = ints(100 + r, 11, torch.float32)
        with t.phase("inplace"):
            same = t.all_reduce(x, inplace=True)
        out["inplace_is_input"] = same is x
        with t.phase("all_gather"):
            out["all_gather"] = t.all_gather(ints(200 + r, 5, torch.bfloat16))
        with t.phase("all_gather_v"):
            out["all_gather_v"] = t.all_gather_v(ints(300 + r, 0 if r == 1 else r + 2, torch.int64))
        counts = [(r + j) % 3 for j in range(n)]
        with t.phase("all_to_all_v"):
            out["all_to_all_v"] = t.all_to_all_v(ints(400 + r, sum(counts), torch.float32), counts)
        known = [(j + r) % 3 for j in range(n)]  # what rank j sends to r: (j + r) % 3
        with t.phase("all_to_all_v:known"):
            out["all_to_all_v:known"] = t.all_to_all_v(
                ints(400 + r, sum(counts), torch.float32), counts, recv_counts=known
            )
        with t.phase("reduce_scatter"):
            out["reduce_scatter"] = t.reduce_scatter(ints(1000 + r, 23, torch.float32), algorithm="ring")
        with t.phase("reduce_scatter:halving"):  # 2 and 4 ranks: powers of two
            out["reduce_scatter:halving"] = t.reduce_scatter(ints(1050 + r, 21, torch.int64), algorithm="halving")
        with t.phase("reduce_scatter:auto"):  # the backend's own: MPI's MPI_Reduce_scatter, gloo's the ring
            out["reduce_scatter:auto"] = t.reduce_scatter(ints(1100 + r, 24, torch.bfloat16))
        with t.phase("broadcast"):
            out["broadcast"] = t.broadcast(ints(500 + r, 6, torch.uint8, high=2), src=n - 1)
        with t.phase("send_recv"):
            payload = ints(600 + r, 3 + r, torch.uint8, high=200)
            out["send_recv"] = t.send_recv(payload, dst=(r + 1) % n, src=(r - 1) % n, device=torch.device("cpu"))
        t.barrier()

        async def interleaved() -> list[torch.Tensor]:
            # Issued together, awaited in reverse: the issue order alone must match across ranks.
            handles = [t.all_reduce_async(ints(700 + r + k, 9, torch.float32)) for k in range(4)]
            handles.append(t.all_gather_v_async(ints(800 + r, r + 1, torch.float32)))
            return [await h for h in reversed(handles)]

        with t.phase("async"):
            out["async"] = run_sync(interleaved())
        sub = t.split(r % 2)
        out["split"] = (sub.rank, sub.world_size, sub.all_reduce(ints(900 + r, 4, torch.int64)))
    out["traffic"] = {
        phase: (p.bytes_sent, p.bytes_recv, p.control_bytes_sent, p.control_bytes_recv, p.num_calls)
        for phase, p in log.phases.items()
    }
    return out


def case_collectives(rank: int) -> dict[str, Any]:
    mpi = MPITransport(timeout=60)
    buffer = torch.arange(10, dtype=torch.float32)
    view = MPITransport.buffer_of(buffer)
    zero_copy = view.ctypes.data == buffer.data_ptr() and view.nbytes == buffer.numel() * 4
    result = {"mpi": _battery(mpi), "gloo": _battery(TorchTransport()), "zero_copy": zero_copy}
    mpi.close()
    return result


def case_mixed(rank: int) -> dict[str, Any]:
    """gloo and MPI mixed per call: a fixed table that splits the battery over both, and the table
    ``tune`` measured here; each run's results and traffic against gloo alone."""
    mpi, gloo = MPITransport(timeout=60), TorchTransport()
    backends = {"gloo": gloo, "mpi": mpi}
    fixed = TuningTable(
        default="gloo",
        entries=(
            TuningEntry(op="all_reduce", backend="mpi", max_bytes=64),
            TuningEntry(op="all_to_all_v", backend="mpi"),
            TuningEntry(op="send_recv", backend="mpi"),
        ),
    )
    tuned, _ = tune(backends, sizes=[8, 4096, 1 << 18], reps=3)
    out: dict[str, Any] = {"gloo": _battery(gloo), "tuned_table": tuned.to_json()}
    for label, table in (("fixed", fixed), ("tuned", tuned)):
        mixed = MixedTransport(backends, table)
        out[label] = _battery(mixed)
        out[f"{label}_routed"] = dict(mixed.routed)
        gen = torch.Generator().manual_seed(rank)
        x = torch.zeros(200, 4)
        x[torch.randperm(200, generator=gen)[:15]] = torch.randint(1, 5, (15, 4), generator=gen).float()
        out[f"{label}_zen"] = (zensync.sparse_allreduce(x, scheme="zen", group=mixed), gloo.all_reduce(x.reshape(-1)))
    mpi.close()
    return out


def case_sparse(rank: int) -> dict[str, Any]:
    """Every scheme's sparse_allreduce over MPI and over gloo, and the dense sum (integer values)."""
    mpi, gloo = MPITransport(timeout=60), TorchTransport()
    gen = torch.Generator().manual_seed(rank)
    x = torch.zeros(300, 4)
    rows = torch.randperm(300, generator=gen)[:20]
    x[rows] = torch.randint(1, 5, (20, 4), generator=gen).float()
    dense = gloo.all_reduce(x.reshape(-1)).view(300, 4)
    out: dict[str, Any] = {"reference": dense}
    for scheme in zensync.SCHEMES:
        out[scheme] = {
            "mpi": zensync.sparse_allreduce(x, scheme=scheme, group=mpi),
            "gloo": zensync.sparse_allreduce(x, scheme=scheme, group=gloo),
        }
    mpi.close()
    return out


HOOK_STRATEGIES = ("dense", "zen", "auto", "fp16", "topk:0.05", "powersgd:2")
FIXED_MODEL = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e8, "adapt": False}


HOOK_TABLE = TuningTable(
    default="gloo",
    entries=(
        TuningEntry(op="all_reduce", backend="mpi", max_bytes=4096),
        TuningEntry(op="all_gather_v", backend="mpi"),
    ),
)
"""The mixed dispatch of the hook test: small all-reduces and the uneven gathers on MPI, the rest on gloo."""


def _train(rank: int, strategy: str, transport: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _Net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    tuning = {"tuning": HOOK_TABLE} if transport == "mixed" else {}
    state = zensync.register(ddp, strategy=strategy, transport=transport, **tuning, **FIXED_MODEL)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, target = _batch(rank, step)
        torch.nn.functional.cross_entropy(ddp(ids), target).backward()
        optimizer.step()
    schemes = sorted({p["scheme"] for h in state.history for p in h["params"].values()})
    kind = type(state.runtime.transport).__name__
    routed = dict(getattr(state.runtime.transport, "routed", {}))
    state.close()
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "schemes": schemes, "transport": kind, "routed": routed}


def case_hook(rank: int) -> dict[str, Any]:
    """The DDP hook with its collectives over MPI, over gloo and mixed (HOOK_TABLE), strategy by strategy."""
    return {s: {t: _train(rank, s, t) for t in ("mpi", "torch", "mixed")} for s in HOOK_STRATEGIES}


def _device_battery(t: Transport, device: torch.device) -> dict[str, Any]:
    """The collectives on tensors of ``device`` (produced there after a long kernel on its current
    stream, so a staging copy that did not wait for it would read stale data); results on CPU."""
    r, n = t.rank, t.world_size

    def on(x: torch.Tensor) -> torch.Tensor:
        if device.type == "cpu":
            return x
        busy = torch.ones(2048, 2048, device=device)
        for _ in range(8):
            busy = busy @ busy / 2048  # queued before the input's own copy on the same stream
        return x.to(device, non_blocking=True) + busy[0, : x.numel()].mul(0).to(x.dtype)

    def back(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            assert x.device.type == device.type, (x.device, device)
            return x.cpu()
        return [back(y) for y in x] if isinstance(x, (list, tuple)) else x

    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        out[f"all_reduce:{dtype}"] = back(t.all_reduce(on(ints(r, 37, dtype))))
    x = on(ints(100 + r, 11, torch.float32))
    out["inplace_is_input"] = t.all_reduce(x, inplace=True) is x
    out["inplace"] = back(x)
    out["all_gather"] = back(t.all_gather(on(ints(200 + r, 5, torch.bfloat16))))
    out["all_gather_v"] = back(t.all_gather_v(on(ints(300 + r, 0 if r == 1 else r + 2, torch.int64))))
    counts = [(r + j) % 3 for j in range(n)]
    out["all_to_all_v"] = back(t.all_to_all_v(on(ints(400 + r, sum(counts), torch.float32)), counts)[0])
    out["broadcast"] = back(t.broadcast(on(ints(500 + r, 6, torch.uint8, high=2)), src=n - 1))
    payload = on(ints(600 + r, 3 + r, torch.uint8, high=200))
    out["send_recv"] = back(t.send_recv(payload, dst=(r + 1) % n, src=(r - 1) % n, device=device))
    gen = torch.Generator().manual_seed(r)
    sparse = torch.zeros(300, 4)
    sparse[torch.randperm(300, generator=gen)[:20]] = torch.randint(1, 5, (20, 4), generator=gen).float()
    out["zen"] = back(zensync.sparse_allreduce(on(sparse), scheme="zen", group=t))
    return out


def case_cuda(rank: int) -> dict[str, Any]:
    """MPITransport on CUDA tensors (pinned host staging unless ZENSYNC_MPI_CUDA_AWARE=1) against
    the same collectives on CPU tensors: the same values, results back on the device."""
    mpi = MPITransport(timeout=60)
    result = {"cuda": _device_battery(mpi, torch.device("cuda")), "cpu": _device_battery(mpi, torch.device("cpu"))}
    result["cuda_aware"] = mpi.cuda_aware
    mpi.close()
    return result


def case_tables_differ(rank: int) -> dict[str, Any]:
    """transport="mixed" with a routing table that differs between ranks: registration fails alike
    on every rank (a differing table would send one call to two backends and hang)."""
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(_Net())
    table = TuningTable(default="gloo", entries=(TuningEntry(op="all_reduce", backend="mpi", max_bytes=64 << rank),))
    try:
        zensync.register(ddp, strategy="dense", transport="mixed", tuning=table, **FIXED_MODEL)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def case_bad_input(rank: int) -> dict[str, Any]:
    """Mismatched shapes over MPI: every rank gets the same ValueError; an unsummable dtype: TypeError."""
    mpi = MPITransport(timeout=60)
    out: dict[str, Any] = {}
    try:
        zensync.sparse_allreduce(torch.zeros(10 + rank, 2), scheme="zen", group=mpi)
    except ValueError as exc:
        out["shape"] = str(exc)
    try:
        mpi.all_reduce(torch.zeros(3, dtype=torch.bool))
    except TypeError as exc:
        out["dtype"] = str(exc)
    out["after"] = mpi.all_reduce(torch.ones(2))  # the transport still works
    mpi.close()
    return out


def case_raise(rank: int) -> dict[str, Any]:
    """Rank 1 raises while rank 0 waits in a collective: python -m mpi4py aborts the job."""
    mpi = MPITransport(timeout=60)
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    mpi.all_reduce(torch.ones(2))
    return {}


def case_stall(rank: int) -> dict[str, Any]:
    """Rank 1 never calls the collective: rank 0's watchdog aborts the job after its 3 s timeout."""
    mpi = MPITransport(timeout=3)
    if rank == 1:
        time.sleep(120)
    mpi.all_reduce(torch.ones(2))
    return {}


def main() -> None:
    case, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, _ = init_torch_distributed("gloo", timeout=60)
    result = globals()[f"case_{case}"](rank)
    torch.save(result, out_dir / f"rank{rank}.pt")
    # The case's DDP model (a reference cycle) holds the group: freed now, while the group and MPI
    # are alive. Left to the interpreter's teardown, a case whose registration failed ended about one
    # run in eight in "terminate called without an active exception" after writing its result.
    gc.collect()
    launch.destroy()


if __name__ == "__main__":
    main()
