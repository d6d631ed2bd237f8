"""What every sync scheme shares: the item view of a tensor, the per-call context, phase timing,
and the ``SyncScheme`` interface with its registry.

A scheme's ``run`` is a coroutine that awaits the transport's non-blocking collectives
(``transport.all_gather_v_async`` and so on), so the same code serves the blocking API
(``transport.run(coro)``) and the DDP hook, which drives it by completion callbacks (``Task`` on a
``Lane``). Inside ``run`` never call a blocking collective: it would block a backend's callback thread.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import inspect
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

import torch

from zensync import kernels
from zensync.transport import Transport
from zensync.types import Granularity, SyncStats, accumulation_dtype, index_dtype

if TYPE_CHECKING:
    from zensync.sync.zen import PreparedPush

__all__ = [
    "ItemView",
    "SyncContext",
    "SyncOptions",
    "SyncScheme",
    "accumulation_dtype",
    "default_granularity",
    "for_scheme",
    "get_scheme",
    "index_dtype",
    "item_view",
    "local_records",
    "register_scheme",
    "scheme_registry",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncOptions:
    """Tunables of the sparse schemes (all ranks must pass the same values)."""

    h0_seed: int | None = None
    """Seed of Zen's first-level hash; None: rank 0 draws one at first use of the group."""
    sparcml_dense_ratio: float = 1.0
    """SparCML switches a stage to dense once COO bytes exceed this fraction of dense bytes."""
    omnireduce_block: int = 256
    """OmniReduce block size in elements."""
    latency_s: float = 50e-6
    """auto: per-message latency alpha of the cost model (seconds)."""
    bandwidth_bytes_per_s: float = 1.25e9
    """auto: per-rank bandwidth of the cost model (bytes/s; 1.25e9 = 10 Gbit/s)."""

    def __post_init__(self) -> None:
        if not 0 < self.sparcml_dense_ratio <= 1.0:
            raise ValueError(f"sparcml_dense_ratio={self.sparcml_dense_ratio} must be in (0, 1]")
        if self.omnireduce_block < 1:
            raise ValueError(f"omnireduce_block={self.omnireduce_block} must be >= 1")
        if self.latency_s < 0 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError(
                f"latency_s={self.latency_s} must be >= 0 and bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} > 0"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class ItemView:
    """A tensor seen as ``num_items`` items of ``item_numel`` elements each."""

    x2d: torch.Tensor
    """(num_items, item_numel), contiguous."""
    granularity: Granularity

    @property
    def num_items(self) -> int:
        return self.x2d.shape[0]

    @property
    def item_numel(self) -> int:
        return self.x2d.shape[1]

    @property
    def item_bytes(self) -> int:
        """Value bytes of one item."""
        return self.x2d.shape[1] * self.x2d.element_size()


def default_granularity(tensor: torch.Tensor) -> Granularity:
    """What 'auto' means: rows for 2-D tensors (embedding gradients), elements otherwise."""
    return "row" if tensor.dim() == 2 else "element"


def item_view(tensor: torch.Tensor, granularity: Granularity) -> ItemView:
    """Rows (dim 0 slices) as items in row mode, single elements in element mode."""
    flat = tensor.contiguous()
    if granularity == "row":
        x2d = flat.reshape(flat.shape[0], math.prod(flat.shape[1:]))
    else:
        x2d = flat.reshape(-1, 1)
    return ItemView(x2d=x2d, granularity=granularity)


@dataclasses.dataclass(kw_only=True, slots=True)
class SyncContext:
    """Everything one call of a scheme needs."""

    transport: Transport
    view: ItemView
    stats: SyncStats
    options: SyncOptions
    h0_seed: int
    """The agreed seed (see ``zensync.sync.agreement``)."""
    nnz_per_rank: list[int] | None = None
    """Non-zero items of every rank, where the caller measured them before the scheme ran."""
    out: torch.Tensor | None = None
    """Where the sum goes: a contiguous tensor of ``view.x2d``'s shape and dtype, or None (a new one)."""
    out_is_input: bool = False
    """``out`` is ``view.x2d`` itself: the items no rank has non-zero are zero there already."""
    items: torch.Tensor | None = None
    """Ascending unique int64 ids of every item that may be non-zero on this rank (a superset: all
    others are zero), known without a scan (a COO tensor's indices, the DDP hook's detection or row
    hints); None: a scheme finds the non-zero items by scanning ``view.x2d``."""
    values: torch.Tensor | None = None
    """The (len(items), item_numel) rows of ``items`` where ``view.x2d`` holds no data (a COO input,
    whose ``view.x2d`` is a stride-0 zero view); None: rows are read from ``view.x2d``."""
    sparse_out: bool = False
    """Return the sum as a coalesced sparse COO tensor (sparse_dim 1) instead of a dense one."""
    push: PreparedPush | None = None
    """Zen's Step 1.1 done before the call's agreement, with the counts it carried (``zensync.sync.zen``)."""
    divisor: int = 1
    """Each rank's values are divided by this before they are summed (DDP's averaging, the same
    ``x / n`` DDP computes), by schemes whose ``divides`` is True: they touch only the non-zero
    items to do it."""

    def local_records(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's non-zero records: ``local_records`` of this call's view, items, values, divisor."""
        return local_records(self.view.x2d, self.items, self.values, self.divisor)

    def output(self) -> torch.Tensor:
        """The tensor a scheme writes the sum into, zero wherever it will not write.

        ``out`` as it is when it is the input (no pass over it: only the union is written, and the
        input is read before), ``out`` zero-filled otherwise, or a new zero tensor without ``out``
        (``kernels.zeros``: on CPU only the pages the scheme writes are ever touched).
        A scheme that writes its sum here returns this tensor; ``run_agreed_async`` copies any
        other returned tensor into ``out``.
        """
        if self.out is None:
            x2d = self.view.x2d
            return kernels.zeros(x2d.shape, x2d.dtype, x2d.device)  # untouched pages cost nothing
        if not self.out_is_input:
            self.out.zero_()
        return self.out

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute traffic to ``name`` and add the enclosed wall time to stats.phase_time_s.

        The transport takes the phase when a collective is issued, so a collective issued inside the
        block and awaited there is counted under ``name`` whatever thread completes it.
        """
        start = time.perf_counter()
        with self.transport.phase(name):
            try:
                yield
            finally:
                times = self.stats.phase_time_s
                times[name] = times.get(name, 0.0) + time.perf_counter() - start


def local_records(
    x2d: torch.Tensor, items: torch.Tensor | None, values: torch.Tensor | None, divisor: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending int64 non-zero item ids, their (k, item_numel) rows divided by ``divisor``).

    From ``items`` (a superset, ``SyncContext.items``; rows read once from ``values`` or ``x2d``,
    exactly-zero rows dropped: the result is what a scan finds) or by a scan of ``x2d``.
    """
    if items is None:
        items = kernels.nonzero_items(x2d)
        rows = x2d.index_select(0, items)
    else:
        rows = values if values is not None else x2d.index_select(0, items)
        keep = kernels.nonzero_items(rows)
        if keep.numel() != rows.shape[0]:
            items, rows = items[keep], rows[keep]
    if divisor != 1:
        rows = rows / divisor
    return items, rows


class SyncScheme(abc.ABC):
    """A lossless way to sum a tensor over ranks.

    ``run`` is a coroutine: it awaits the transport's ``*_async`` collectives and returns the (not
    averaged) sum as a (num_items, item_numel) tensor in the input dtype, identical on every rank:
    ``ctx.output()`` filled in (schemes that write the sum item by item), or a new tensor. It
    fills what it observes into ``ctx.stats``. A scheme reads ``ctx.view`` before it writes
    ``ctx.output()``: they may be the same memory. Schemes hold no state between calls: one
    instance per name serves every call (``get_scheme``).
    """

    name: ClassVar[str]
    records: ClassVar[bool] = False
    """Whether ``run`` honours ``ctx.items``/``ctx.values`` and ``ctx.sparse_out`` (it works from
    the non-zero records alone); other schemes get a materialized dense ``view.x2d``."""
    divides: ClassVar[bool] = False
    """Whether ``run`` applies ``ctx.divisor``; others get a divided dense copy (``for_scheme``)."""

    @abc.abstractmethod
    async def run(self, ctx: SyncContext) -> torch.Tensor:
        """Sum ``ctx.view`` over the ranks of ``ctx.transport``."""


def for_scheme(ctx: SyncContext, scheme: SyncScheme) -> SyncContext:
    """``ctx`` as ``scheme`` can run it: as it is for a scheme of ``records`` (and ``divides``);
    otherwise with a materialized dense ``view.x2d``, already divided (one pass over the tensor)."""
    if scheme.records and (scheme.divides or ctx.divisor == 1):
        return ctx
    if ctx.values is None and ctx.divisor == 1:
        return dataclasses.replace(ctx, items=None)  # a scanning scheme: items were only a hint
    x2d = ctx.view.x2d
    if ctx.values is not None:
        assert ctx.items is not None
        dense = kernels.zeros(x2d.shape, x2d.dtype, x2d.device)
        dense[ctx.items] = ctx.values if ctx.divisor == 1 else ctx.values / ctx.divisor
    else:
        dense = x2d / ctx.divisor
    same_out = ctx.out_is_input
    return dataclasses.replace(
        ctx,
        view=ItemView(x2d=dense, granularity=ctx.view.granularity),
        items=None,
        values=None,
        divisor=1,
        out=dense if same_out else ctx.out,  # the sum goes to the new tensor, copied back by the caller
        out_is_input=same_out,
    )


_REGISTRY: dict[str, type[SyncScheme]] = {}
_INSTANCES: dict[str, SyncScheme] = {}
"""The one instance of each registered scheme, built at registration (schemes are stateless)."""


def register_scheme(cls: type[SyncScheme]) -> type[SyncScheme]:
    """Class decorator adding a scheme to the registry under ``cls.name``.

    Raises:
        ValueError: The name is taken.
        TypeError: ``run`` is a plain function (schemes are coroutines of non-blocking collectives).
    """
    if cls.name in _REGISTRY:
        raise ValueError(f"sync scheme {cls.name!r} is registered twice")
    if not inspect.iscoroutinefunction(cls.run):
        raise TypeError(
            f"sync scheme {cls.name!r}: run must be a coroutine ('async def run(self, ctx)') that awaits "
            f"the transport's *_async collectives, e.g. 'await ctx.transport.all_reduce_async(x)'"
        )
    _REGISTRY[cls.name] = cls
    _INSTANCES[cls.name] = cls()
    return cls


def get_scheme(name: str) -> SyncScheme:
    """The scheme registered under ``name`` (the same instance on every call; nothing is copied).

    Raises:
        ValueError: ``name`` is not a registered scheme (the message lists the valid ones).
    """
    scheme = _INSTANCES.get(name)
    if scheme is None:
        raise ValueError(f"sync scheme {name!r} is unknown (valid: {', '.join(_INSTANCES)})")
    return scheme


def scheme_registry() -> dict[str, type[SyncScheme]]:
    """The registered scheme classes by name (a copy: for listing, not for running a scheme)."""
    return dict(_REGISTRY)
