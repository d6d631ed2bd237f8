"""``sparse_allreduce`` on real processes over gloo (CPU), world sizes 2 and 4 (4 in the slow tier).

Process start and gloo init cost seconds, so each class launches its workers once per world size
and runs a whole battery of calls in them; the tests then assert on what the ranks sent back.

Oracles are exact. Every input holds small integers (each rank contributes values in {-3..3}), so
every summation order gives the same float result in every dtype, half types included:

1. the closed-form sum, computed here in float64 from the same seeds the workers used;
2. ``torch.distributed.all_reduce`` of the same dense tensor, computed in the same worker;
3. ``SimulatedWorld`` running the same call on the same inputs, for the bytes each phase moved.

Run alone with ``python -m pytest tests/distributed/sync`` (world size 4: add ``-m slow``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import pytest
import torch

import zensync
from tests.distributed._launch import launch, pytest_generate_tests, slow_world, world_size_fixture  # noqa: F401 - class data world_size

H0_SEED = 123
"""Fixed hash seed on gloo and in the simulated world, so Zen's partitions (and bytes) match."""
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
SHAPES = ((1003,), (301, 4))
"""1-D (element mode) and 2-D (row mode); neither size divides by the world size or by 32."""
FILLS = ("zero", "1%", "30%", "full", "single")
"""Densities 0, ~1 %, ~30 %, 100 %, and one non-zero on the last rank only."""
_DENSITY = {"zero": 0.0, "1%": 0.01, "30%": 0.3, "full": 1.0}
_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
MAX_REPORTED = 15
"""Failures listed per assertion; the count of the rest is given."""


# --------------------------------------------------------------------------------------------------
# Inputs: a pure function of (case, rank, world_size), evaluated in the workers and in this process.
@dataclasses.dataclass(frozen=True)
class Case:
    """One ``sparse_allreduce`` call, identical on every rank except for each rank's data."""

    seed: int
    scheme: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: str
    average: bool = False
    special: str = ""
    """'' | 'nan_inf' (NaN and +Inf on one rank each) | 'negzero' (-0.0 in place of zeros)."""
    layout: str = "contiguous"
    """'contiguous' | 'strided' (a transposed view for 2-D, a stride-2 view for 1-D)."""
    granularity: str = "auto"

    @property
    def name(self) -> str:
        parts = [self.scheme, str(self.dtype).removeprefix("torch."), "x".join(map(str, self.shape)), self.fill]
        parts += [p for p in (self.special, "avg" if self.average else "", self.granularity) if p not in ("", "auto")]
        return "/".join(parts + ([self.layout] if self.layout != "contiguous" else []))


def _battery_cases() -> list[Case]:
    """Every scheme over dtypes, shapes and fills, then the special values, averaging and layouts."""
    specs = [dict(dtype=d, shape=s, fill=f) for d, s, f in itertools.product(DTYPES, SHAPES, FILLS)]
    specs += [dict(dtype=d, shape=s, fill="30%", special="nan_inf") for d, s in itertools.product(DTYPES, SHAPES)]
    for dtype, shape in itertools.product((torch.float32, torch.bfloat16), SHAPES):
        specs.append(dict(dtype=dtype, shape=shape, fill="30%", average=True))
        specs.append(dict(dtype=dtype, shape=shape, fill="30%", special="negzero"))
    for shape in SHAPES:
        specs.append(dict(dtype=torch.float32, shape=shape, fill="30%", layout="strided"))
    specs.append(dict(dtype=torch.float32, shape=(5, 7, 29), fill="30%"))  # 3-D: element mode
    specs.append(dict(dtype=torch.float32, shape=(301, 4), fill="30%", granularity="element"))
    # Edge shapes: empty (element and row mode, and zero-width rows); fewer items than ranks.
    specs += [dict(dtype=torch.float32, shape=s, fill="zero") for s in ((0,), (0, 4), (4, 0))]
    specs += [dict(dtype=torch.float32, shape=s, fill="full") for s in ((3,), (2, 5))]
    schemes = zensync.SCHEMES
    return [Case(seed=i, scheme=sc, **sp) for i, (sp, sc) in enumerate(itertools.product(specs, schemes))]


def _row_mode(case: Case) -> bool:
    return case.granularity == "row" or (case.granularity == "auto" and len(case.shape) == 2)


def make_input(case: Case, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous input: items (rows or elements) non-zero at random, values in +-{1,2,3}."""
    gen = torch.Generator().manual_seed(case.seed * 1009 + rank)
    numel = 1
    for size in case.shape:
        numel *= size
    num_items = case.shape[0] if _row_mode(case) else numel
    item_numel = numel // num_items if num_items else 0
    magnitudes = torch.randint(1, 4, (num_items, item_numel), generator=gen)
    signs = torch.randint(0, 2, (num_items, item_numel), generator=gen) * 2 - 1
    if case.fill == "single":
        keep = torch.zeros(num_items, dtype=torch.bool)
        keep[num_items // 2] = rank == world_size - 1
    else:
        keep = torch.rand(num_items, generator=gen) < _DENSITY[case.fill]
    x = ((magnitudes * signs) * keep[:, None]).to(torch.float64).reshape(case.shape)
    x = _add_special(x.reshape(-1), case.special, rank, world_size).reshape(case.shape)
    return x.to(case.dtype)


def _add_special(flat: torch.Tensor, special: str, rank: int, world_size: int) -> torch.Tensor:
    if special == "nan_inf":
        if rank == 0:
            flat[0] = float("nan")
        if rank == world_size - 1:
            flat[-1] = float("inf")
    elif special == "negzero":
        if rank % 2 == 0:
            flat = torch.where(flat == 0, torch.tensor(-0.0, dtype=flat.dtype), flat)
        flat[:5] = -0.0  # -0.0 on every rank: dense all_reduce gives -0.0 there
    return flat


def with_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values in the memory layout the case asks for."""
    if layout == "contiguous":
        return x
    if x.dim() == 2:
        return x.t().contiguous().t()  # a transposed view: strides (1, rows)
    buf = torch.zeros(2 * x.numel(), dtype=x.dtype)
    buf[::2] = x.reshape(-1)
    return buf[::2].view(x.shape)


def closed_form(case: Case, world_size: int) -> torch.Tensor:
    """The exact sum (or average) of every rank's input, in float64, rounded once to the case dtype."""
    total = sum(make_input(case, r, world_size).to(torch.float64) for r in range(world_size))
    if case.average:
        total = total / world_size
    return total.to(case.dtype)


# --------------------------------------------------------------------------------------------------
# Comparisons
def bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns: equality here is bitwise (NaN == NaN with the same payload; -0.0 != 0.0)."""
    return x.contiguous().view(_INT_VIEW[x.dtype])


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal as all_reduce results compare: NaN where the other has NaN, ==  elsewhere (-0.0 == 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def check_all(items, check) -> None:
    """Assert ``check(item)`` (a failure description or None) is None for every item; list failures."""
    failures = [msg for msg in map(check, items) if msg is not None]
    shown = "\n".join(failures[:MAX_REPORTED])
    more = f"\n... and {len(failures) - MAX_REPORTED} more" if len(failures) > MAX_REPORTED else ""
    assert not failures, f"{len(failures)} of {len(items)} failed:\n{shown}{more}"


def traffic(stats: zensync.SyncStats) -> dict[str, dict[str, int]]:
    """Per-phase byte and message counters (wall times dropped: they differ run to run)."""
    return {
        name: {k: v for k, v in dataclasses.asdict(p).items() if k != "comm_time_s"}
        for name, p in sorted(stats.phases.items())
    }


def ring_recv_bytes(numel: int, world_size: int, rank: int, element_size: int) -> int:
    """The ring model of transport/base.py: rank r receives 2 * (numel - chunk_r) elements."""
    chunk = numel // world_size + (1 if rank < numel % world_size else 0)
    return 2 * (numel - chunk) * element_size


# --------------------------------------------------------------------------------------------------
# Worker side of the correctness battery (runs in every spawned rank).
def _battery_worker(rank: int, world_size: int, cases: list[Case]) -> dict[str, dict]:
    import torch.distributed as dist

    records = {}
    for case in cases:
        x = with_layout(make_input(case, rank, world_size), case.layout)
        before = x.clone()
        stats = zensync.SyncStats()
        try:
            out = zensync.sparse_allreduce(
                x,
                scheme=case.scheme,
                average=case.average,
                granularity=case.granularity,
                stats=stats,
                options=zensync.SyncOptions(h0_seed=H0_SEED),
            )
        except Exception as exc:  # noqa: BLE001 - reported by test_no_call_raised
            records[case.name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        ref = before.clone(memory_format=torch.contiguous_format)  # the input as passed
        dist.all_reduce(ref)
        if case.average:
            ref = ref / world_size
        records[case.name] = {
            "out": out,
            "ref": ref,
            "strided_input": not x.is_contiguous(),
            "input_unchanged": torch.equal(bits(x), bits(before)),
            "shares_input_storage": out.numel() > 0
            and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(),
            "scheme_ran": stats.scheme,
            "traffic": traffic(stats),
        }
    return records


# --------------------------------------------------------------------------------------------------
class TestGlooSparseAllreduce:
    """Every scheme, dtype, shape and density on real gloo ranks, against exact oracles."""

    world_size = [2, slow_world(4)]

    @pytest.fixture(scope="class")
    @classmethod
    def battery(cls, world_size, tmp_path_factory):
        cases = _battery_cases()
        start = time.monotonic()
        results = launch(_battery_worker, world_size, (cases,), tmp_path_factory.mktemp(f"battery{world_size}"))
        print(f"world {world_size}: {len(cases)} calls per rank in {time.monotonic() - start:.1f} s")
        return cases, results

    @staticmethod
    def _ok(battery):
        """(case, per-rank records) for the cases that ran on every rank."""
        cases, results = battery
        return [(c, [r[c.name] for r in results]) for c in cases if all("error" not in r[c.name] for r in results)]

    def test_no_call_raised(self, battery):
        cases, results = battery
        check_all(
            [(c, rank, r[c.name]) for c in cases for rank, r in enumerate(results)],
            lambda t: f"{t[0].name} rank {t[1]}: {t[2]['error']}" if "error" in t[2] else None,
        )

    def test_equals_closed_form_sum(self, battery, world_size):
        def check(item):
            case, recs = item
            expected = closed_form(case, world_size)
            bad = [rank for rank, rec in enumerate(recs) if not same_values(rec["out"], expected)]
            return f"{case.name}: ranks {bad} differ from the exact sum" if bad else None

        check_all(self._ok(battery), check)

    def test_equals_dense_all_reduce(self, battery):
        def check(item):
            case, recs = item
            bad = [rank for rank, rec in enumerate(recs) if not same_values(rec["out"], rec["ref"])]
            return f"{case.name}: ranks {bad} differ from dist.all_reduce" if bad else None

        check_all(self._ok(battery), check)

    def test_nan_and_inf_propagate(self, battery):
        special = [(c, recs) for c, recs in self._ok(battery) if c.special == "nan_inf"]
        assert special

        def check(item):
            case, recs = item
            flat = recs[0]["out"].reshape(-1)
            if not (torch.isnan(flat[0]) and flat[-1] == float("inf")):
                return f"{case.name}: got {flat[0].item()} at the NaN and {flat[-1].item()} at the +Inf"
            return None

        check_all(special, check)

    def test_identical_on_every_rank(self, battery):
        def check(item):
            case, recs = item
            bad = [rank for rank, rec in enumerate(recs) if not torch.equal(bits(rec["out"]), bits(recs[0]["out"]))]
            return f"{case.name}: ranks {bad} differ bitwise from rank 0" if bad else None

        check_all(self._ok(battery), check)

    def test_input_not_modified(self, battery):
        def check(item):
            case, recs = item
            bad = [rank for rank, rec in enumerate(recs) if not rec["input_unchanged"]]
            return f"{case.name}: ranks {bad} had their input modified" if bad else None

        check_all(self._ok(battery), check)

    def test_output_is_new_tensor_like_input(self, battery):
        def check(item):
            case, recs = item
            for rank, rec in enumerate(recs):
                out = rec["out"]
                if (tuple(out.shape), out.dtype, out.device.type) != (case.shape, case.dtype, "cpu"):
                    return f"{case.name} rank {rank}: got {tuple(out.shape)} {out.dtype} {out.device}"
                if rec["shares_input_storage"]:
                    return f"{case.name} rank {rank}: output shares the input's storage"
            return None

        check_all(self._ok(battery), check)

    def test_strided_inputs_were_strided(self, battery):
        strided = [(c, recs) for c, recs in self._ok(battery) if c.layout == "strided"]
        assert strided
        assert all(rec["strided_input"] for _, recs in strided for rec in recs)

    def test_dense_bytes_follow_ring_model(self, battery, world_size):
        def check(item):
            case, recs = item
            for rank, rec in enumerate(recs):
                numel = rec["out"].numel()
                expected = ring_recv_bytes(numel, world_size, rank, rec["out"].element_size())
                got = rec["traffic"].get("allreduce", {}).get("bytes_recv", 0)
                total = sum(p["bytes_recv"] for p in rec["traffic"].values())
                validate = rec["traffic"]["validate"]["bytes_recv"]
                if got != expected or total != expected + validate:
                    return f"{case.name} rank {rank}: allreduce recv {got} (total {total}), ring model {expected}"
            return None

        dense = [(c, recs) for c, recs in self._ok(battery) if c.scheme == "dense"]
        assert dense
        check_all(dense, check)

    def test_bytes_match_simulated_world(self, battery, world_size):
        """Both transports account with one model: every phase counter equal on every rank."""

        def check(item):
            case, recs = item
            stats = [zensync.SyncStats() for _ in range(world_size)]
            sim_out = zensync.SimulatedWorld(world_size, timeout_s=60).run(
                lambda t: zensync.sparse_allreduce(
                    with_layout(make_input(case, t.rank, world_size), case.layout),
                    group=t,
                    scheme=case.scheme,
                    average=case.average,
                    granularity=case.granularity,
                    stats=stats[t.rank],
                    options=zensync.SyncOptions(h0_seed=H0_SEED),
                )
            )
            for rank, rec in enumerate(recs):
                if stats[rank].scheme != rec["scheme_ran"]:
                    return f"{case.name} rank {rank}: sim ran {stats[rank].scheme}, gloo {rec['scheme_ran']}"
                if traffic(stats[rank]) != rec["traffic"]:
                    return f"{case.name} rank {rank}: sim {traffic(stats[rank])} != gloo {rec['traffic']}"
                if not same_values(sim_out[rank], rec["out"]):
                    return f"{case.name} rank {rank}: sim and gloo results differ"
            return None

        check_all(self._ok(battery), check)
