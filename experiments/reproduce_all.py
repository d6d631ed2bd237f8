"""Every scaling reproduction of issue 16, one after another: one command, resumable, with progress.

Launch (from the repository root; about 1 hour on 2 cores, most of it the emulated cluster)::

    python experiments/reproduce_all.py                 # everything not yet done today
    python experiments/reproduce_all.py --list          # the steps and whether each is done
    python experiments/reproduce_all.py --only zen espresso --fresh
    python experiments/reproduce_all.py --skip validation   # without root (no network namespaces)

Steps (each a driver of this folder or a ``zensync simulate`` command; each writes its own dated
report under experiments/results/, and the drivers that sweep points cache them, so an interrupted
step resumes where it stopped):

=============  ===================================================================================
zen            ``zen_scaling.py``: Zen's schemes at n = 2..1024 on LSTM/DeepFM/NMT statistics and
               the LM; AGsparse's crossover (Zen Fig. 8); speedups at 16 x 8 (Figs. 15, 17);
               push/pull imbalance (Theorem 2)
espresso       ``espresso_repro.py``: FP32/FP16/compress-all/planned iteration time, Table 1,
               selection times (Tables 5-6), gap to the upper bound, ablation (Fig. 15)
cupcake        ``cupcake_fusion.py``: none vs layer-wise vs fused compression, exact fusion vs
               brute force (Cupcake's 2.03x / 1.79x)
volume         ``compression_volume.py``: DeepSpeed-style 1-bit volume, every compressor's bytes
zipf10m        ``zensync simulate`` of a 10M x 64 Zipf embedding at n = 2..1024 (counted points,
               local work fitted)
resnet50       ``zensync simulate --model resnet50`` at n = 8..1024: DDP buckets vs the plan
local-work     ``local_work_check.py``: counted points' fitted local work vs full runs
validation     ``simulate_validation.py`` (root): predicted vs measured on the emulated cluster
=============  ===================================================================================

A step is done when its state file (``experiments/results/reproduce_all_<date>.json``) says so;
``--fresh`` reruns the chosen steps. A failed step is reported and the others still run; the exit
status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results"
TODAY = datetime.date.today().isoformat()
PY = sys.executable

STEPS: dict[str, list[str]] = {
    "zen": [PY, str(HERE / "zen_scaling.py")],
    "espresso": [PY, str(HERE / "espresso_repro.py")],
    "cupcake": [PY, str(HERE / "cupcake_fusion.py")],
    "volume": [PY, str(HERE / "compression_volume.py")],
    "zipf10m": [
        PY, "-m", "zensync", "simulate", "--items", "10000000", "--dim", "64", "--density", "0.01", "--skew", "1.1",
        "--overlap", "0.3", "--ranks", "2,4,8,16,32,64,128,256,512,1024", "--inter", "25Gbit", "--png",
        "-o", str(RESULTS / f"simulate_zipf10M_25gbit_local_{TODAY}"),
    ],
    "resnet50": [
        PY, "-m", "zensync", "simulate", "--model", "resnet50", "--ranks", "8,16,32,64,128,256,512,1024",
        "--inter", "25Gbit", "--png", "-o", str(RESULTS / f"simulate_resnet50_dgc_25gbit_{TODAY}"),
    ],
    "local-work": [PY, str(HERE / "local_work_check.py")],
    "validation": [PY, str(HERE / "simulate_validation.py")],
}  # fmt: skip
NEEDS_ROOT = {"validation"}


def _state_path() -> pathlib.Path:
    return RESULTS / f"reproduce_all_{TODAY}.json"


def _load() -> dict[str, dict[str, object]]:
    path = _state_path()
    return json.loads(path.read_text()) if path.exists() else {}


def _save(state: dict[str, dict[str, object]]) -> None:
    RESULTS.mkdir(exist_ok=True)
    _state_path().write_text(json.dumps(state, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(STEPS), help="run these steps only")
    parser.add_argument("--skip", nargs="+", choices=list(STEPS), default=[], help="leave these steps out")
    parser.add_argument("--fresh", action="store_true", help="rerun the chosen steps even if done today")
    parser.add_argument("--list", action="store_true", help="list the steps and their state, run nothing")
    args = parser.parse_args(argv)
    chosen = [s for s in (args.only or list(STEPS)) if s not in args.skip]
    state = _load()
    if args.list:
        for name in STEPS:
            entry = state.get(name, {})
            print(f"{name:12s} {entry.get('status', 'not run'):8s} {' '.join(STEPS[name][1:])}")
        return 0
    failed = []
    for index, name in enumerate(chosen, 1):
        prefix = f"[{index}/{len(chosen)}] {name}"
        if state.get(name, {}).get("status") == "done" and not args.fresh:
            print(f"{prefix}: done earlier today, skipped (--fresh reruns it)", flush=True)
            continue
        if name in NEEDS_ROOT and os.geteuid() != 0:
            print(f"{prefix}: needs root (network namespaces); skipped", flush=True)
            state[name] = {"status": "skipped", "why": "not root"}
            _save(state)
            continue
        print(f"{prefix}: {' '.join(STEPS[name])}", flush=True)
        started = time.perf_counter()
        code = subprocess.run(STEPS[name], cwd=HERE.parent, check=False).returncode
        seconds = round(time.perf_counter() - started, 1)
        state[name] = {"status": "done" if code == 0 else "failed", "exit": code, "seconds": seconds}
        _save(state)
        print(f"{prefix}: {'done' if code == 0 else f'FAILED (exit {code})'} in {seconds} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
