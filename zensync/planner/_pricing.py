"""Every candidate option priced for every tensor, and the O(1) pricing of one-unit changes (max-plus).

Shared by the plan search (``search.py``) and fusion (``_fusion.py``); see ``search.py`` for what is
exact and what is heuristic.
"""

from __future__ import annotations

import copy

import numpy as np

from zensync.cost import CompressorModel, Device, FloatArray
from zensync.planner import _compiled_timeline as timeline
from zensync.planner.cluster import ClusterSpec
from zensync.planner.options import SCHEMES, OptionCosts, Scheme, TensorOption, candidate_options, option_costs
from zensync.planner.profile import ModelProfile
from zensync.planner.simulator import Unit

__all__ = ["MaxPlus", "PricedOptions"]


class PricedOptions:
    """Every candidate option priced for every tensor (one vectorised ``option_costs`` call each)."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: ClusterSpec,
        model: CompressorModel,
        *,
        devices: tuple[Device, ...] = ("gpu",),
        two_level: bool = False,
        schemes: tuple[Scheme, ...] = SCHEMES,
        hierarchical: bool = True,
    ) -> None:
        self.profile, self.cluster, self.model = profile, cluster, model
        self.numel = np.array([float(t.numel) for t in profile.tensors])
        self.ready = np.array([t.ready_s for t in profile.tensors])
        self.cache: dict[int, int] = {}
        options = candidate_options(
            cluster, model, devices=devices, two_level=two_level, schemes=schemes, hierarchical=hierarchical
        )
        self._set_options(options, [self.price(option, self.numel) for option in options])

    def _set_options(self, options: tuple[TensorOption, ...], costs: list[OptionCosts]) -> None:
        """Index ``options`` (priced as ``costs``) and lay their prices out for the timelines."""
        self.options, self.costs = options, costs
        self.index = {option: k for k, option in enumerate(self.options)}
        self.stage_arrays = self._stage_arrays()
        """Every option's prices as ``timeline`` takes them: compute ``[K, n]``, stage resources ``[K, S]``
        (a stage's resource depends on the option only), stage seconds ``[K, n, S]``, stage counts ``[K]``."""
        self.gpu = np.array([k for k, o in enumerate(self.options) if o.device == "gpu"])
        # GPU options run (wait, comm): the rows MaxPlus prices.
        compute, _, seconds, _ = self.stage_arrays
        self.compute, self.wait, self.comm = compute[self.gpu], seconds[self.gpu, :, 0], seconds[self.gpu, :, 1]

    def without_gpu_compression(self) -> PricedOptions:
        """The same prices with the GPU-compressed options left out (the CPU-only space), not priced again.

        Equal to a fresh ``PricedOptions`` with ``devices`` less ``"gpu"``: ``candidate_options`` lists the
        options device by device, so dropping GPU compression keeps the order of the rest.
        """
        keep = [k for k, option in enumerate(self.options) if option.kind != "comp" or option.device != "gpu"]
        restricted = copy.copy(self)
        restricted._set_options(tuple(self.options[k] for k in keep), [self.costs[k] for k in keep])
        return restricted

    def gpu_upper_bound(self) -> PricedOptions:
        """The GPU options alone, priced at zero compression cost and no compute interference (Espresso's
        Upper Bound, ``option_costs(upper_bound=True)``), for the compiled timeline (``iteration_s``)."""
        options = tuple(self.options[k] for k in self.gpu)
        bound = copy.copy(self)
        bound._set_options(options, [self.price(option, self.numel, upper_bound=True) for option in options])
        return bound

    def price(self, option: TensorOption, numel: FloatArray, upper_bound: bool = False) -> OptionCosts:
        return option_costs(
            option,
            numel,
            self.cluster,
            self.model,
            dtype_bytes=self.profile.dtype_bytes,
            upper_bound=upper_bound,
            cache=self.cache,
        )

    def gpu_row(self, option_index: int) -> int:
        """Row of a GPU option in ``compute``/``wait``/``comm``."""
        return int(np.flatnonzero(self.gpu == option_index)[0])

    def unit(self, i: int, option_index: int) -> Unit:
        costs, option = self.costs[option_index], self.options[option_index]
        kernel_s = float(costs.kernel_s[i])
        return Unit(
            label=self.profile.tensors[i].name,
            ready_s=float(self.ready[i]),
            compute_s=float(costs.compute_s[i]),
            stages=tuple((resource, float(seconds[i])) for resource, seconds in costs.stages),
            gpu_kernel_s=kernel_s if option.device == "gpu" else 0.0,
            cpu_kernel_s=kernel_s if option.device == "cpu" else 0.0,
        )

    def iteration_s(self, choice: np.ndarray) -> float:
        """Simulated iteration time of an unfused choice, from the prices already computed.

        The event loop of ``simulate`` on the same units, compiled (``zensync.planner._compiled_timeline``, equal
        to the Python loop bit for bit), without pricing the options again.
        """
        compute, resource, seconds, num_stages = self.stage_arrays
        columns = np.arange(len(choice))
        return float(
            timeline.iteration_time(
                self.profile.forward_s,
                self.profile.backward_s,
                self.ready,
                compute[choice, columns],
                resource[choice],
                seconds[choice, columns],
                num_stages[choice],
                self.cluster.cpu_workers,
            )
        )

    def _stage_arrays(self) -> tuple[FloatArray, np.ndarray, FloatArray, np.ndarray]:
        codes = {"wait": timeline.WAIT, "comm": timeline.COMM, "cpu": timeline.CPU}
        max_stages = max(len(costs.stages) for costs in self.costs)
        k, n = len(self.costs), len(self.numel)
        resource = np.full((k, max_stages), timeline.WAIT, np.int8)
        seconds = np.zeros((k, n, max_stages))
        for o, costs in enumerate(self.costs):
            for stage, (name, duration) in enumerate(costs.stages):
                resource[o, stage] = codes[name]
                seconds[o, :, stage] = duration
        compute = np.stack([costs.compute_s for costs in self.costs])
        return compute, resource, seconds, np.array([len(costs.stages) for costs in self.costs], np.int64)

    def best_level(self, kind: str) -> np.ndarray:
        """Per tensor, the option index of ``kind`` (fp32 or fp16) with the shortest comm (flat or hier)."""
        rows = [r for r, k in enumerate(self.gpu) if self.options[k].kind == kind]
        best = np.argmin(self.comm[rows], axis=0)
        return self.gpu[np.array(rows)[best]]


class MaxPlus:
    """Iteration time of a GPU-only strategy, and of any one-unit change to it in O(1).

    Units (tensors or groups) ``u`` have raw ready time ``r``, compute charge ``e``, wait ``w`` (at most
    ``e``) and comm time ``d``. Unit u joins the comm queue at ``c_u = r_u + sum(e[:u]) + w_u``, in unit
    order, so the stream ends at ``L = max_u (c_u + sum(d[u:]))`` and the iteration takes
    ``forward + max(backward + sum(e), L)``.
    """

    def __init__(
        self, ready: FloatArray, e: FloatArray, w: FloatArray, d: FloatArray, forward: float, backward: float
    ) -> None:
        self.ready, self.e, self.w, self.d = ready, e.copy(), w.copy(), d.copy()
        self.forward, self.backward = forward, backward
        self.refresh()

    def refresh(self) -> None:
        """Recompute the prefix/suffix maxima after a change."""
        cum_e = np.cumsum(self.e)
        self.e_before = cum_e - self.e
        self.e_total = float(cum_e[-1])
        self.suffix_d = np.cumsum(self.d[::-1])[::-1]
        x = self.ready + self.e_before + self.w + self.suffix_d
        running = np.maximum.accumulate(x)
        self.prefix_max = np.concatenate(([-np.inf], running[:-1]))
        self.suffix_max = np.concatenate((np.maximum.accumulate(x[::-1])[::-1][1:], [-np.inf]))
        self.comm_end = float(running[-1])
        self.last_peak = int(np.flatnonzero(x == self.comm_end)[-1])
        self.time = self.forward + max(self.backward + self.e_total, self.comm_end)

    @property
    def compute_bound(self) -> bool:
        return self.backward + self.e_total >= self.comm_end

    def times_with(self, u: int, e: FloatArray, w: FloatArray, d: FloatArray) -> FloatArray:
        """Iteration times with unit u's (e, w, d) replaced by each candidate (arrays)."""
        de, dd = e - self.e[u], d - self.d[u]
        own = self.ready[u] + self.e_before[u] + w + d + (self.suffix_d[u] - self.d[u])
        comm_end = np.maximum(np.maximum(self.prefix_max[u] + dd, own), self.suffix_max[u] + de)
        return self.forward + np.maximum(self.backward + self.e_total + de, comm_end)

    def apply(self, u: int, e: float, w: float, d: float) -> None:
        self.e[u], self.w[u], self.d[u] = e, w, d
        self.refresh()
