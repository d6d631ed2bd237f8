"""Run one experiment on this checkout and on another revision, interleaved, in one session.

A shared machine is noisy: a before/after comparison is only fair when both revisions run side by
side, alternating, so that load hits both alike. This driver checks ``--before`` out into a
temporary git worktree, then runs the same command ``--rounds`` times in each checkout (current
first, then before), each with that checkout as its working directory and first on PYTHONPATH, and
keeps what each run printed and the result files it wrote under ``experiments/results``.

Launch (from the repository root)::

    python benchmarks/revision_compare.py --before 3a91d20 --name hook_overhead --rounds 2 -- \\
        python experiments/hook_sweep.py --only overhead --steps 8 --rounds 3

Output: ``experiments/results/revision_compare/<name>/<label>_<round>.log`` (the run's output) and
``.../<label>_<round>/<file>`` (every result file the run created or changed), where label is
``current`` or the before revision. The comparison itself is read from those files.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = pathlib.Path("experiments") / "results"


def _snapshot(checkout: pathlib.Path) -> dict[pathlib.Path, float]:
    folder = checkout / RESULTS
    return {p: p.stat().st_mtime for p in folder.glob("*") if p.is_file()} if folder.is_dir() else {}


def _run(command: list[str], checkout: pathlib.Path, out_dir: pathlib.Path, label: str) -> tuple[float, int]:
    """Run ``command`` in ``checkout``; keep its output and the result files it wrote.

    Returns the seconds it took and its exit status (an experiment exits 1 when one of its own
    checks fails; its results are kept all the same).
    """
    before = _snapshot(checkout)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    (out_dir / f"{label}.log").write_text(
        f"$ {' '.join(command)}\n# exit {done.returncode}\n{done.stdout}{done.stderr}"
    )
    written = [p for p, mtime in _snapshot(checkout).items() if before.get(p) != mtime]
    if written:
        keep = out_dir / label
        keep.mkdir(exist_ok=True)
        for path in written:
            shutil.copy2(path, keep / path.name)
    return seconds, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the revision to compare against (a commit or ref)")
    parser.add_argument("--name", required=True, help="folder name under experiments/results/revision_compare")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run in each checkout")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    if command[0] == "python":
        command[0] = sys.executable
    out_dir = ROOT / RESULTS / "revision_compare" / args.name
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="zensync-before-") as tmp:
        before = pathlib.Path(tmp) / "checkout"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True)
        try:
            for round_ in range(args.rounds):
                for label, checkout in (("current", ROOT), (args.before, before)):
                    seconds, status = _run(command, checkout, out_dir, f"{label}_{round_}")
                    print(f"round {round_} {label}: {seconds:.0f} s, exit {status}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=True)
    print(f"outputs in {out_dir}")


if __name__ == "__main__":
    main()
