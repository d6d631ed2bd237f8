"""In-memory checkpoints on the emulated cluster (issue 18's targets), with the demo's LM under DDP + zensync.

4 worker hosts at --rate (1 Gbit/s) and a 5th host, the storage server, behind a --storage-rate link
(100 Mbit/s) that serves the torch.distributed.checkpoint files over HTTP: the stand-in for remote
persistent storage. Every worker trains the seeded demo LM (DDP, zensync "auto", SGD) on the same
batches. Three phases:

1. **overhead**: per round, the same steps without checkpoints and with ``Checkpointer`` saving every
   step with --replicas peer replicas (Gemini's group placement), in alternating order (with
   --floor, also with ``FloorCheckpoint``, the least work any per-step checkpoint of this job must
   do: the physical limit of this machine, measured in the same rounds). Reported:
   step time (max over ranks per step, median over steps) of each, and from the checkpointer's
   per-step records the shard's bytes, the save's time, the replicated bytes, idle windows used, the
   longest delay a chunk imposed on a gradient sync, and the coverage lag (steps between the newest
   save and the newest step whose every shard has its replicas).
2. **failure**: training with checkpoints (and a disk checkpoint every --dcp-every steps, served by
   the storage host); in step --kill-step, after its backward, host 3's worker SIGKILLs itself; the
   other workers fail in their next collective. Then host 3 is replaced: its namespace is deleted
   with everything in it and rebuilt at the same address (``EmulatedCluster.replace_host``), and
   its store is deleted (its agent and memory are gone).
3. **recovery**: every worker restarts and calls ``Checkpointer.restore``: host 3 fetches its shard
   from its peer's memory. Reported: the path, the step restored, steps lost beyond the one in
   flight, the restore's time on host 3, then, on host 3 alone, the time to fetch the same state
   from the storage host (its DCP files over HTTP) and load it; training then runs to --steps and
   the final parameters are compared with an uninterrupted run's.

    python experiments/resilience_bench.py                    # 4 hosts at 1gbit, storage at 100mbit
    python experiments/resilience_bench.py --rounds 1 --steps 10
    python experiments/resilience_bench.py --rounds 6 --steps 20 --kill-step 15 --floor   # and the floor

Needs root (network namespaces). Writes experiments/results/resilience_<label>_<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import versions, write

import zensync
from zensync.demo.config import DemoConfig
from zensync.demo.model import DemoModel, batch, lm_config
from zensync.resilience import CheckpointConfig, Checkpointer
from zensync.resilience.blocks import hash_bytes
from zensync.resilience.checkpointer import load_dcp_state
from zensync.resilience.dirty import ChangeTracker
from zensync.resilience.memory import load_parts, state_of
from zensync.resilience.store import flatten
from zensync.testbed import EmulatedCluster
from zensync.transport.dcp import METADATA, dcp_rank_files, dcp_steps
from zensync.workloads import lm

_PORT, _HTTP_PORT = 29741, 8731
WORKERS = 4
STORAGE = 4  # host index of the storage server
VICTIM = 3
FIXED = {"adapt": False, "latency_s": 50e-6, "bandwidth_bytes_per_s": 1.25e8}
"""auto's choices from a 1 Gbit/s network model, not from measured times: the uninterrupted run
and the restored one choose alike, so their final parameters can be compared bit for bit."""


def _setup(config: DemoConfig) -> tuple[nn.Module, Any, Any, torch.optim.Optimizer]:
    model = DemoModel(config, generator=torch.Generator().manual_seed(config.seed))
    ddp = DistributedDataParallel(model)
    state = zensync.register(ddp, strategy="auto", **FIXED)
    return model, ddp, state, torch.optim.SGD(model.parameters(), lr=config.lr)


def _step(ddp: Any, opt: torch.optim.Optimizer, corpus: torch.Tensor, config: DemoConfig, step: int,
          kill: bool = False) -> float:  # fmt: skip
    inputs, targets = batch(corpus, config, dist.get_rank(), step)
    opt.zero_grad()
    logits = ddp(inputs)
    loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    if kill:
        os.kill(os.getpid(), signal.SIGKILL)
    opt.step()
    return float(loss.detach())


def _ckpt_config(args: argparse.Namespace, **kw: Any) -> CheckpointConfig:
    return CheckpointConfig(root=f"{args.stores}/host{dist.get_rank()}", replicas=args.replicas, ranks_per_host=1,
                            chunk_bytes=args.chunk_kib << 10, replicate_every=args.replicate_every,
                            max_lag_steps=args.max_lag, dedup=args.dedup, **kw)  # fmt: skip


class FloorCheckpoint:
    """The least work any every-step checkpoint of this job must do, as ``Checkpointer.save`` is called:
    the state taken (the parts' state dicts, flattened, the values encoded as JSON), the rows the
    optimizer step changed (``ChangeTracker``, as the real one knows them) copied into this process's
    memory and hashed, and one all-gather per step of a round's agreement size (``ROUND_BYTES``:
    the digests and manifests of a data parallel round) on a thread and a group of its own. It keeps
    no version, no file, no manifest and no replica, and verifies nothing: it cannot restore. Its
    overhead is the floor, on this machine, under any implementation of the issue's checkpoints."""

    ROUND_BYTES = 7 << 10

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=120))
        self.tracker = ChangeTracker()
        self.copies: dict[str, np.ndarray] = {}
        self._steps: list[int | None] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._rounds, daemon=True)
        self._thread.start()

    def save(self, step: int, **parts: Any) -> dict[str, Any]:
        started_s = time.perf_counter()
        tensors, values = flatten({name: state_of(part) for name, part in parts.items()}, check=False)
        json.dumps(values, allow_nan=True)
        self.tracker.attach(parts)
        changed = self.tracker.changes(tensors)
        written = 0
        for key, tensor in tensors.items():
            src = tensor.detach().numpy()
            rows = changed.get(key)
            if key not in self.copies or rows is None or src.ndim < 2:
                dst = self.copies.setdefault(key, np.empty_like(src))
                dst[...] = src
                hash_bytes(dst.reshape(-1).view(np.uint8))
                written += src.nbytes
            else:
                taken = src[rows]
                self.copies[key][rows] = taken
                hash_bytes(taken.reshape(-1).view(np.uint8))
                written += taken.nbytes
        self.tracker.saved()
        with self._cond:
            self._steps.append(step)
            self._cond.notify()
        return {"step": step, "bytes": sum(c.nbytes for c in self.copies.values()), "written_bytes": written,
                "save_s": time.perf_counter() - started_s}  # fmt: skip

    def _rounds(self) -> None:
        row = torch.zeros(self.ROUND_BYTES // 8, dtype=torch.int64)
        table = torch.zeros(row.numel() * dist.get_world_size(), dtype=torch.int64)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._steps))
                step = self._steps.pop(0)
            if step is None:
                return
            row[0] = step
            dist.all_gather_into_tensor(table, row, group=self.group)

    def close(self) -> None:
        with self._cond:
            self._steps.append(None)
            self._cond.notify()
        self._thread.join()


def _train(args: argparse.Namespace, corpus: torch.Tensor, mode: str) -> dict[str, Any]:
    """--warmup + --steps barrier-fenced steps: without checkpoints ("off"), with ``Checkpointer``
    ("on"), or with ``FloorCheckpoint`` ("floor")."""
    config = DemoConfig()
    model, ddp, state, opt = _setup(config)
    ckpt: Checkpointer | FloorCheckpoint | None = None
    if mode == "on":
        ckpt = Checkpointer(_ckpt_config(args), hook_state=state)
        shutil.rmtree(ckpt.store.root, ignore_errors=True)
        ckpt.store.root.mkdir(parents=True)
        ckpt.restore(model=model, optimizer=opt, zensync=state)
    elif mode == "floor":
        ckpt = FloorCheckpoint()
    times, cpus, records = [], [], []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        _step(ddp, opt, corpus, config, step)
        if ckpt is not None:
            records.append(ckpt.save(step, model=model, optimizer=opt, zensync=state))
        dist.barrier()
        times.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu_start)  # every thread: training, gloo's, the replicator
    if ckpt is not None:
        ckpt.close()
    state.close()
    return {"step_s": times[args.warmup :], "cpu_s": cpus[args.warmup :], "records": records[args.warmup :]}


def _overhead(args: argparse.Namespace, corpus: torch.Tensor) -> dict[str, Any]:
    modes = ["off", "on", "floor"] if args.floor else ["off", "on"]
    out: dict[str, Any] = {mode: {"step_s": [], "cpu_s": [], "records": []} for mode in modes}
    for round_ in range(args.rounds):  # each mode first, then last, in turn
        k = round_ % len(modes)
        for mode in modes[k:] + modes[:k] if args.floor else (modes if k == 0 else modes[::-1]):
            run = _train(args, corpus, mode)
            for key in ("step_s", "cpu_s", "records"):
                out[mode][key] += run[key]
    return out


def _failure(args: argparse.Namespace, corpus: torch.Tensor) -> None:
    config = DemoConfig()
    model, ddp, state, opt = _setup(config)
    ckpt = Checkpointer(_ckpt_config(args, dcp_dir=args.disk, dcp_every=args.dcp_every), hook_state=state)
    assert ckpt.restore(model=model, optimizer=opt, zensync=state) == 0
    for step in range(args.kill_step + 1):
        _step(ddp, opt, corpus, config, step, kill=step == args.kill_step and dist.get_rank() == VICTIM)
        ckpt.save(step, model=model, optimizer=opt, zensync=state)


def _from_storage(args: argparse.Namespace, step: int) -> dict[str, Any]:
    """Host 3 alone: its DCP files from the storage host over HTTP, loaded into a fresh model."""
    start = time.perf_counter()
    local = pathlib.Path(tempfile.mkdtemp(prefix="zensync-storage-"))
    url = f"http://{args.storage_ip}:{_HTTP_PORT}/step{step}"
    fetched = 0
    for name in [METADATA]:
        fetched += _download(f"{url}/{name}", local / name)
    for name in dcp_rank_files(local, VICTIM):
        fetched += _download(f"{url}/{name}", local / name)
    state = load_dcp_state(local, None, rank=VICTIM)
    config = DemoConfig()
    model = DemoModel(config, generator=torch.Generator().manual_seed(config.seed))
    load_parts(state, {"model": model})
    shutil.rmtree(local)
    return {"seconds": time.perf_counter() - start, "bytes": fetched, "step": step}


def _download(url: str, path: pathlib.Path) -> int:
    with urllib.request.urlopen(url, timeout=120) as response, open(path, "wb") as f:
        shutil.copyfileobj(response, f, 1 << 20)
    return path.stat().st_size


def _recovery(args: argparse.Namespace, corpus: torch.Tensor) -> dict[str, Any]:
    config = DemoConfig()
    model, ddp, state, opt = _setup(config)
    ckpt = Checkpointer(_ckpt_config(args, dcp_dir=args.disk), hook_state=state)
    start = ckpt.restore(require=True, model=model, optimizer=opt, zensync=state)
    recovery = dict(ckpt.recovery or {})
    for step in range(start, args.steps):
        _step(ddp, opt, corpus, config, step)
        ckpt.save(step, model=model, optimizer=opt, zensync=state)
    ckpt.close()
    dist.barrier()
    newest_disk = max(dcp_steps(args.disk))  # the storage host's newest checkpoint: the same bytes
    storage = _from_storage(args, newest_disk) if dist.get_rank() == VICTIM else None
    dist.barrier()
    state.close()
    # the uninterrupted run of the same steps, for the final parameters
    ref, ref_ddp, ref_state, ref_opt = _setup(config)
    for step in range(args.steps):
        _step(ref_ddp, ref_opt, corpus, config, step)
    ref_state.close()
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return {"recovery": recovery, "storage": storage, "max_param_diff": diff}


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=120))
    corpus = torch.load(args.corpus)
    out = {"overhead": _overhead, "failure": _failure, "recovery": _recovery}[args.phase](args, corpus)
    if out is not None:
        torch.save(out, pathlib.Path(args.out, f"{args.phase}{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _run_phase(cluster: EmulatedCluster, args: argparse.Namespace, phase: str, extra: list[str]) -> list[int]:
    procs = []
    for r in range(WORKERS):
        env = {**cluster.env_for_torch(r, _PORT + len(phase)), "WORLD_SIZE": str(WORKERS), "OMP_NUM_THREADS": "1"}
        procs.append(cluster.popen(r, [sys.executable, os.path.abspath(__file__), *extra, "--phase", phase], env))
    deadline = time.monotonic() + args.timeout_s
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    return [p.returncode for p in procs]


def _summary(
    overhead: list[dict[str, Any]], recovery: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    def slowest(mode: str) -> list[float]:
        return [max(r[mode]["step_s"][i] for r in overhead) for i in range(len(overhead[0][mode]["step_s"]))]

    off, on = statistics.median(slowest("off")), statistics.median(slowest("on"))
    # each round's own overhead (its two runs back to back): the machine's drift between rounds, which
    # moves a run's steps by more than the checkpoints do, falls out of each ratio
    on_steps, off_steps = slowest("on"), slowest("off")

    def each_round(steps: list[float]) -> list[float]:
        return [statistics.median(steps[k : k + args.steps]) / statistics.median(off_steps[k : k + args.steps]) - 1
                for k in range(0, len(steps), args.steps)]  # fmt: skip

    per_round = each_round(on_steps)

    # the CPU every rank's process used per step (all its threads), summed over ranks: against the
    # machine's cores x the step's wall time, how busy the CPUs were
    def cpu(mode: str) -> float:
        return statistics.median(
            sum(r[mode]["cpu_s"][i] for r in overhead) for i in range(len(overhead[0][mode]["cpu_s"]))
        )

    cpu_off, cpu_on = cpu("off"), cpu("on")
    floor: dict[str, Any] = {}
    if "floor" in overhead[0]:  # the least any checkpoint must do, in the same rounds (FloorCheckpoint)
        floor_steps = slowest("floor")
        floor = {"step_s_floor": statistics.median(floor_steps), "cpu_s_floor": cpu("floor"),
                 "overhead_floor": statistics.median(floor_steps) / off - 1.0,
                 "overhead_floor_rounds": each_round(floor_steps),
                 "save_s_floor": statistics.median(rec["save_s"] for r in overhead
                                                   for rec in r["floor"]["records"])}  # fmt: skip
    records = [rec for r in overhead for rec in r["on"]["records"]]
    runs = [
        r["on"]["records"][i : i + args.steps] for r in overhead for i in range(0, len(r["on"]["records"]), args.steps)
    ]
    # each run's rounds after its first (whole) one: deltas
    deltas = [f for run in runs for f in [f for rec in run for f in rec.get("sent_fractions", [])][1:]]
    donated = [f for rec in records for f in rec.get("donated_fractions", [])]
    rounds = [t for rec in records for t in rec.get("round_s", [])]
    round_cpus = [t for run in runs for t in [t for rec in run for t in rec.get("round_cpu_s", [])][1:]]
    # steady state: the steps after a run's first version had all its replicas (deltas from then on)
    steady = []
    for i in range(len(overhead[0]["on"]["records"])):
        if all(r["on"]["records"][i].get("complete_step") is not None for r in overhead):
            steady.append(on_steps[i])
    lags = [rec["step"] - rec.get("complete_step") for rec in records if rec.get("complete_step") is not None]
    victim = recovery[VICTIM]
    return {
        "step_s_off": off, "step_s_on": on, "overhead": on / off - 1.0,
        "cpu_s_off": cpu_off, "cpu_s_on": cpu_on, "cpus": os.cpu_count(), "overhead_rounds": per_round,
        "steady_steps": len(steady), "step_s_on_steady": statistics.median(steady) if steady else None,
        "overhead_steady": statistics.median(steady) / off - 1.0 if steady else None,
        "shard_bytes": statistics.median(rec["bytes"] for rec in records),
        "save_s": statistics.median(rec["save_s"] for rec in records),
        "written_bytes": statistics.median(rec["written_bytes"] for rec in records),
        "lag_wait_s": statistics.median(rec.get("lag_wait_s", 0.0) for rec in records),
        "replicated_bytes_per_step": statistics.mean(rec.get("replicated_bytes", 0) for rec in records),
        "windows_used_per_step": statistics.mean(rec.get("windows_used", 0) for rec in records),
        "max_delay_s": max(rec.get("max_delay_s", 0.0) for rec in records),
        "median_delay_s": statistics.median(rec.get("max_delay_s", 0.0) for rec in records),
        "coverage_lag_median": statistics.median(lags) if lags else None, "coverage_lag_max": max(lags, default=None),
        "sent_fraction_median": statistics.median(deltas) if deltas else None,
        "donated_fraction_median": statistics.median(donated) if donated else None,
        "round_s_median": statistics.median(rounds) if rounds else None,
        "round_cpu_s_median": statistics.median(round_cpus) if round_cpus else None,
        "recovery": victim["recovery"], "storage": victim["storage"],
        "sender_pack_s": max(r["recovery"].get("pack_s", 0.0) for r in recovery),
        "recovery_speedup": (victim["storage"]["seconds"] / victim["recovery"]["seconds"]
                             if victim["recovery"]["source"] == "peers" else None),
        "lost_beyond_in_flight": args.kill_step - 1 - victim["recovery"]["step"],
        "max_param_diff": max(r["max_param_diff"] for r in recovery), **floor,
    }  # fmt: skip


def _rate_bits(rate: str) -> float:
    """A tc rate ("1gbit", "100mbit") in bits per second."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
    unit = next(u for u in units if rate.endswith(u))
    return float(rate.removesuffix(unit)) * units[unit]


def _markdown(meta: dict[str, Any], s: dict[str, Any]) -> str:
    rec, sto = s["recovery"], s["storage"]
    return "\n".join([
        f"# In-memory checkpoints: {meta['label']}, {meta['date']}", "",
        f"Command: `{meta['command']}`. zensync {meta['zensync']}, torch {meta['torch']}, Python {meta['python']}, "
        f"{meta['cpus']} CPUs. {WORKERS} worker hosts at {meta['rate']}, storage host at {meta['storage_rate']}; "
        f"demo LM, DDP + zensync auto, SGD; replicas={meta['replicas']} (group placement), "
        f"chunk {meta['chunk_kib']} KiB, replicated every {meta['replicate_every']} step(s); "
        f"{meta['rounds']} rounds x {meta['steps']} steps after {meta['warmup']}.", "",
        "| | value |", "|---|---|",
        f"| step without checkpoints (s, median of max over ranks) | {s['step_s_off']:.4f} |",
        f"| step with a checkpoint every step + {meta['replicas']} replica (s) | {s['step_s_on']:.4f} |",
        f"| overhead | {100 * s['overhead']:+.1f} % (target <= 5 %) |",
        f"| overhead of each round (its runs with and without, back to back): median / min / max | "
        f"{100 * statistics.median(s['overhead_rounds']):+.1f} / {100 * min(s['overhead_rounds']):+.1f} / "
        f"{100 * max(s['overhead_rounds']):+.1f} % ({len(s['overhead_rounds'])} rounds) |",
        f"| CPU per step, all {WORKERS} ranks' processes (ms, median): without / with checkpoints | "
        f"{1e3 * s['cpu_s_off']:.1f} / {1e3 * s['cpu_s_on']:.1f} (the machine's {s['cpus']} cores give "
        f"{1e3 * s['cpus'] * s['step_s_off']:.0f} per step without) |",
        *([f"| **floor** (`FloorCheckpoint`: the least any per-step checkpoint must do), same rounds: step (s), "
           f"overhead, each round's median / min / max | {s['step_s_floor']:.4f}, {100 * s['overhead_floor']:+.1f} %, "
           f"{100 * statistics.median(s['overhead_floor_rounds']):+.1f} / {100 * min(s['overhead_floor_rounds']):+.1f}"
           f" / {100 * max(s['overhead_floor_rounds']):+.1f} % |",
           f"| floor: CPU per step, all ranks (ms, median); its save (ms, median) | {1e3 * s['cpu_s_floor']:.1f}; "
           f"{1e3 * s['save_s_floor']:.2f} |"] if "step_s_floor" in s else []),
        f"| the same, steady state ({s['steady_steps']} steps after the first version had its replicas) | "
        + (f"{s['step_s_on_steady']:.4f} s, {100 * s['overhead_steady']:+.1f} % |" if s["steady_steps"] else "none |"),
        f"| shard per rank (MB) | {s['shard_bytes'] / 1e6:.2f} |",
        f"| save into shared memory (ms, median) | {1e3 * s['save_s']:.2f} |",
        f"| written by the save (MB, median: the rows that changed) | {s['written_bytes'] / 1e6:.2f} |",
        f"| waited for the lag bound (ms, median; --max-lag {meta['max_lag']}) | {1e3 * s['lag_wait_s']:.2f} |",
        f"| replicated per step per rank (MB) | {s['replicated_bytes_per_step'] / 1e6:.2f} |",
        f"| of a version's data sent as a delta (median over rounds after a run's first) | "
        f"{s['sent_fraction_median']} |",
        f"| of a version's data the peer copied from its own version (dedup {meta['dedup']}; median over rounds) | "
        f"{s['donated_fraction_median']} |",
        f"| replication round, start to every replica verified (s, median) | {s['round_s_median']} |",
        "| replication thread's CPU per round after a run's first (ms, median) | "
        + (f"{1e3 * s['round_cpu_s_median']:.2f} |" if s["round_cpu_s_median"] is not None else "- |"),
        f"| idle windows used per step | {s['windows_used_per_step']:.2f} |",
        f"| delay a chunk imposed on a gradient sync (ms, median / max) | "
        f"{1e3 * s['median_delay_s']:.2f} / {1e3 * s['max_delay_s']:.2f} |",
        f"| coverage lag (steps, median / max) | {s['coverage_lag_median']} / {s['coverage_lag_max']} |",
        f"| recovery path of the replaced host | {rec['source']}, step {rec['step']} |",
        f"| steps lost beyond the one in flight | {s['lost_beyond_in_flight']} (target 0) |",
        f"| restore ({rec['source']}) on host {VICTIM} (s) | {rec['seconds']:.3f} "
        f"({rec['fetched_bytes'] / 1e6:.2f} MB fetched; plan / fetch / load {1e3 * rec.get('plan_s', 0):.0f} / "
        f"{1e3 * rec.get('fetch_s', 0):.0f} / {1e3 * rec.get('load_s', 0):.0f} ms; of the fetch, the peer's pack "
        f"{1e3 * s['sender_pack_s']:.0f} ms, the exchange {1e3 * rec.get('exchange_s', 0):.0f} ms, the unpack "
        f"{1e3 * rec.get('unpack_s', 0):.0f} ms; the wire alone "
        f"{1e3 * rec['fetched_bytes'] * 8 / _rate_bits(meta['rate']):.0f} ms) |",
        f"| the same state from the storage host (s; its step {sto['step']}) | {sto['seconds']:.3f} "
        f"({sto['bytes'] / 1e6:.2f} MB) |",
        "| speedup of peers' memory over the storage host | "
        + (f"{s['recovery_speedup']:.1f}x (target >= 5x) |" if s["recovery_speedup"]
           else "n/a: not restored from peers |"),
        f"| final parameters vs uninterrupted run (max abs diff) | {s['max_param_diff']:.2e} |", "",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--storage-rate", default="100mbit")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--replicate-every", type=int, default=1, help="steps between replication rounds")
    p.add_argument("--max-lag", type=int, default=None, help="CheckpointConfig.max_lag_steps (default: no bound)")
    p.add_argument("--dedup", action=argparse.BooleanOptionalAction, default=True, help="CheckpointConfig.dedup")
    p.add_argument("--kill-step", type=int, default=30)
    p.add_argument("--floor", action="store_true", help="also run FloorCheckpoint in each round (the physical limit)")
    p.add_argument(
        "--dcp-every", type=int, default=10, help="disk checkpoints in the failure phase (the storage host's)"
    )
    p.add_argument("--label", default="")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--results-dir", default=str(pathlib.Path(__file__).parent / "results"))
    for hidden in ("--phase", "--out", "--corpus", "--stores", "--disk", "--storage-ip"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase:
        worker(args)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    config = DemoConfig()
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(WORKERS + 1, rate=args.rate) as cluster:
        cluster.set_rate(STORAGE, args.storage_rate)
        corpus = lm.load_corpus(lm_config(config))
        torch.save(corpus.clone(), os.path.join(tmp, "corpus.pt"))
        stores, disk = tempfile.mkdtemp(prefix="zensync-bench-", dir="/dev/shm"), os.path.join(tmp, "disk")
        extra = [*forwarded, "--out", tmp, "--corpus", os.path.join(tmp, "corpus.pt"), "--stores", stores,
                 "--disk", disk, "--storage-ip", cluster.host_ip(STORAGE)]  # fmt: skip
        os.makedirs(disk)
        server = cluster.popen(STORAGE, [sys.executable, "-m", "http.server", str(_HTTP_PORT), "--bind",
                                         cluster.host_ip(STORAGE), "--directory", disk],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            codes = _run_phase(cluster, args, "overhead", extra)
            assert codes == [0] * WORKERS, f"overhead phase exit codes {codes}"
            overhead = [torch.load(os.path.join(tmp, f"overhead{r}.pt")) for r in range(WORKERS)]
            for host in os.listdir(stores):  # a new job: its own stores
                shutil.rmtree(os.path.join(stores, host))
            codes = _run_phase(cluster, args, "failure", extra)
            assert codes[VICTIM] == -signal.SIGKILL, f"failure phase exit codes {codes}"
            cluster.replace_host(VICTIM)  # host 3 replaced: its namespace, processes and link are new
            shutil.rmtree(os.path.join(stores, f"host{VICTIM}"))  # and its agent's memory is gone
            codes = _run_phase(cluster, args, "recovery", extra)
            assert codes == [0] * WORKERS, f"recovery phase exit codes {codes}"
            recovery = [torch.load(os.path.join(tmp, f"recovery{r}.pt")) for r in range(WORKERS)]
        finally:
            server.kill()
            shutil.rmtree(stores, ignore_errors=True)
    summary = _summary(overhead, recovery, args)
    date = datetime.date.today().isoformat()
    label = args.label or f"4x{args.rate}_storage{args.storage_rate}"
    command = " ".join(["python", "experiments/resilience_bench.py", *forwarded])
    meta = {"date": date, "label": label, "command": command,
            "rate": args.rate, "storage_rate": args.storage_rate, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "replicas": args.replicas, "chunk_kib": args.chunk_kib,
            "replicate_every": args.replicate_every, "max_lag": args.max_lag, "kill_step": args.kill_step,
            "dedup": args.dedup, "floor": args.floor,
            "seed": config.seed, **versions()}  # fmt: skip
    write(args.results_dir, f"resilience_{label}_{date}", meta, summary, _markdown(meta, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
