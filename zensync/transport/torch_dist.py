"""The torch.distributed transport: gloo on CPU, NCCL on GPU, one device-agnostic code path.

Every buffer (payloads and the int64 size exchanges) is allocated on the device of the tensor being
moved, so the same code drives gloo with CPU tensors and NCCL with CUDA tensors.

gloo has no uneven all_gather, so ``all_gather_v`` with unequal sizes is an ``all_to_all_single``
in which each rank sends its payload to every peer (exactly the bytes of an all-gather-v), or, for
large messages on gloo, a ring of point-to-point steps (see below).

gloo's ring all_gather pays one wake-up per ring step: about 3.5 ms for 8 bytes among 4 processes
on 2 cores, where one ``all_to_all_single`` carrying the same bytes takes about 0.6 ms
(experiments/results/collective_latency_*). Small all-gathers on gloo (the descriptor, size and
count exchanges) therefore go through ``all_to_all_single``; large ones keep the ring, which uses
the links better (gloo's all_to_all reached about 2/3 of the link rate on 4 shaped hosts, its ring
about 90 %); large uneven ones run as a ring of point-to-point steps with exact sizes.

Non-blocking forms: every collective is issued with ``async_op=True`` and completes through its
work's future (``Handle.from_torch``); a collective that needs sizes first chains its payload after
them in a ``Task``. gloo's point-to-point work has no future ("Work::getFuture not implemented"), so
``send_recv`` and the ring all-gather run on this transport's point-to-point thread, the one place
a thread of zensync's waits for the network, started only when those are used.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from zensync.transport.base import Transport
from zensync.transport.handle import Handle, Task
from zensync.transport.reduce_scatter import Traffic

T = TypeVar("T")

__all__ = ["GradBucket", "TorchTransport", "group_timeout", "transport_for_group"]

logger = logging.getLogger(__name__)

GradBucket = dist.GradBucket
"""DDP's bucket type, re-exported so hooks can name it without importing torch.distributed."""

# torch >= 2.13 renames all_gather_into_tensor (deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SMALL_GATHER_BYTES = 64 * 1024
"""On gloo, all-gathers of at most this many bytes per rank go through all_to_all_single."""


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """The collective timeout of ``group`` (None = the default group), as given to init_process_group.

    Read from the group's backend options; torch's default for the backend when a backend does not
    expose it. Groups zensync creates take this value, so a stuck peer fails every rank in the
    user's timeout instead of torch's 30-minute default for new groups.
    """
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None  # torch.distributed is initialized (the caller's group exists)
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except RuntimeError:  # no backend registered for this device type
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))


class TorchTransport(Transport):
    """``Transport`` over a torch.distributed process group.

    Args:
        group: The process group; None means the default group. The caller must be a member.
        timeout: Collective timeout of the groups this transport creates (``duplicate``, ``split``);
            None: the timeout of ``group`` itself (``group_timeout``).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: datetime.timedelta | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group(...) "
                "first, or pass a zensync Transport (e.g. from SimulatedWorld) as group"
            )
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the process group "
                f"passed as group; call zensync collectives only on ranks of that group"
            )
        super().__init__(rank, dist.get_world_size(group))
        self.group = group
        self.timeout = timeout if timeout is not None else group_timeout(group)
        """Timeout of the groups this transport creates (and of ``group`` unless given otherwise)."""
        backend = dist.get_backend(group)
        self.backend = str(backend)
        """The group's backend ("gloo", "nccl"): the name a mixed dispatch's tuning table gives it."""
        self._small_gather_bytes = SMALL_GATHER_BYTES if backend == "gloo" else 0
        self._stream_ordered = backend == "nccl"
        """NCCL: a work's future completes when the work is queued; ``work.wait()`` orders the stream."""
        self._p2p_thread: threading.Thread | None = None
        self._p2p_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Handle[Any]]] = queue.SimpleQueue()

    def duplicate(self, timeout: datetime.timedelta | None = None) -> TorchTransport:
        """A transport on a new process group with the same ranks (a collective of those ranks).

        Collectives on separate groups never interleave: a comm hook that talks on its own group
        from another thread cannot collide with DDP's own collectives on the model's group (for
        example the unused-parameter map allreduce of find_unused_parameters=True).

        Args:
            timeout: The new group's collective timeout; None: this transport's ``timeout``.
        """
        ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        return self._new_group(ranks, timeout if timeout is not None else self.timeout)

    def _split(self, color: int) -> TorchTransport:
        colors = self._all_gather(torch.tensor([color], dtype=torch.int64, device=self._device())).wait()
        members = [r for r, c in enumerate(torch.cat(colors).tolist()) if c == color]
        return self._new_group([self._global(r) for r in members], self.timeout)

    def _new_group(self, ranks: list[int], timeout: datetime.timedelta) -> TorchTransport:
        """A transport on a new group of global ``ranks`` with ``timeout`` (torch's default would be 30 min)."""
        group = dist.new_group(
            ranks=ranks, timeout=timeout, backend=dist.get_backend(self.group), use_local_synchronization=True
        )
        # Kept alive here: handles completed on the group's own gloo thread may hold the last reference
        # to its transport, and a ProcessGroup destroyed on its own worker thread joins itself
        # ("terminate called ... Resource deadlock avoided" at exit). Held until the interpreter exits.
        _CREATED_GROUPS.append(group)
        return TorchTransport(group, timeout)

    @property
    def control_device(self) -> torch.device:
        return self._device()

    def _device(self) -> torch.device:
        """Device of the group's small control tensors: CUDA for NCCL, CPU otherwise."""
        return torch.device("cuda" if dist.get_backend(self.group) == "nccl" else "cpu")  # the current GPU

    def _global(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` (older torch releases address peers by global rank only)."""
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- non-blocking building blocks ---------------------------------------------------------------
    def _from_work(self, work: Any, convert: Callable[[Any], T]) -> Handle[T]:
        """The handle of an ``async_op=True`` work.

        NCCL: ``work.wait()`` first makes the issuing thread's current stream (the caller's: see
        ``kernels.caller_stream``) wait for the collective, without blocking the host, as the
        blocking form's ``wait`` does; the future alone would not, since NCCL completes it when the
        work is queued and code after it runs on the caller's stream. Unmeasured on a GPU here.
        """
        assert work is not None
        if self._stream_ordered:
            work.wait()
        return Handle.from_torch(work.get_future(), convert)

    def _p2p(self, fn: Callable[[], T]) -> Handle[T]:
        """Run blocking point-to-point work on the point-to-point thread (gloo's p2p work has no future).

        NCCL: inline on the calling thread instead, on the caller's stream (its works' ``wait``
        only orders the stream); a thread of its own would issue on its default stream.
        """
        if self._stream_ordered:
            return Handle.from_call(fn)
        if self._p2p_thread is None:
            self._p2p_thread = threading.Thread(target=self._p2p_loop, name="zensync-p2p", daemon=True)
            self._p2p_thread.start()
        handle: Handle[T] = Handle()
        self._p2p_jobs.put((fn, handle))
        return handle

    def _p2p_loop(self) -> None:
        while True:
            fn, handle = self._p2p_jobs.get()
            Handle.from_call(fn).forward_to(handle)

    def _a2a(
        self,
        out: torch.Tensor,
        send: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> Handle[torch.Tensor]:
        work = dist.all_to_all_single(
            out,
            send,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=self.group,
            async_op=True,
        )
        return self._from_work(work, lambda _: out)

    # -- backend hooks ---------------------------------------------------------------------------------
    def _all_reduce(self, tensor: torch.Tensor) -> Handle[torch.Tensor]:
        # The work's own future: its error keeps the backend's exception type.
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        return self._from_work(work, lambda _: tensor)

    def _all_gather(self, tensor: torch.Tensor) -> Handle[list[torch.Tensor]]:
        n = self.world_size
        out = torch.empty(n * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        if tensor.numel() * tensor.element_size() <= self._small_gather_bytes:
            done = self._a2a(out, tensor.repeat(n))
        else:
            work = _all_gather_single(out, tensor, group=self.group, async_op=True)
            done = self._from_work(work, lambda _: out)
        return done.then(lambda o: list(o.chunk(n)) if tensor.numel() else [o[:0]] * n)

    def _all_gather_v(self, tensor: torch.Tensor) -> Handle[tuple[list[torch.Tensor], int | None]]:
        return Task(self._all_gather_v_steps(tensor)).start()

    async def _all_gather_v_steps(self, tensor: torch.Tensor) -> tuple[list[torch.Tensor], int | None]:
        n = self.world_size
        size = torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device)
        sizes = torch.cat(await self._all_gather(size)).tolist()  # host-device sync
        if all(s == sizes[0] for s in sizes):
            return await self._all_gather(tensor), None
        if self._small_gather_bytes and max(sizes) * tensor.element_size() > self._small_gather_bytes:
            return await self._p2p(lambda: self._ring_all_gather_v(tensor, sizes))
        out = torch.empty(sum(sizes), dtype=tensor.dtype, device=tensor.device)
        await self._a2a(out, tensor.repeat(n), output_split_sizes=sizes, input_split_sizes=[tensor.numel()] * n)
        return list(out.split(sizes)), None

    def _ring_all_gather_v(self, tensor: torch.Tensor, sizes: list[int]) -> tuple[list[torch.Tensor], int]:
        """Uneven all-gather as a ring of point-to-point steps: exact sizes, no padding.

        Step s (0 <= s < n-1): send block (r - s) to the right neighbour, receive block (r - s - 1)
        from the left one. Returns the blocks and the bytes this rank sent (every block but its
        right neighbour's).
        """
        n, r = self.world_size, self.rank
        blocks = [torch.empty(s, dtype=tensor.dtype, device=tensor.device) for s in sizes]
        blocks[r] = tensor
        right, left = self._global((r + 1) % n), self._global((r - 1) % n)
        for step in range(n - 1):
            send, recv = blocks[(r - step) % n], blocks[(r - step - 1) % n]
            ops = []
            if send.numel():
                ops.append(dist.P2POp(dist.isend, send, group=self.group, peer=right))
            if recv.numel():
                ops.append(dist.P2POp(dist.irecv, recv, group=self.group, peer=left))
            for work in dist.batch_isend_irecv(ops) if ops else []:
                work.wait()
        sent = sum(s for j, s in enumerate(sizes) if j != (r + 1) % n) * tensor.element_size()
        return blocks, sent

    def _all_to_all_v(
        self, tensor: torch.Tensor, counts: list[int], recv_counts: list[int] | None
    ) -> Handle[tuple[torch.Tensor, list[int]]]:
        return Task(self._all_to_all_v_steps(tensor, counts, recv_counts)).start()

    async def _all_to_all_v_steps(
        self, tensor: torch.Tensor, counts: list[int], known: list[int] | None
    ) -> tuple[torch.Tensor, list[int]]:
        if known is None:
            send_counts = torch.tensor(counts, dtype=torch.int64, device=tensor.device)
            recv_counts = (await self._a2a(torch.empty_like(send_counts), send_counts)).tolist()  # host-device sync
        else:
            recv_counts = known
        out = torch.empty(sum(recv_counts), dtype=tensor.dtype, device=tensor.device)
        await self._a2a(out, tensor, output_split_sizes=recv_counts, input_split_sizes=counts)
        return out, recv_counts

    def _auto_reduce_scatter(self, tensor: torch.Tensor) -> str:
        """NCCL's own reduce-scatter where the chunks are even; the ring from point-to-point on gloo
        (its reduce_scatter_tensor is an all-reduce: twice the traffic)."""
        even = tensor.numel() % self.world_size == 0
        return "native" if self._stream_ordered and even else "ring"

    def _native_reduce_scatter(self, tensor: torch.Tensor) -> Handle[Traffic]:
        """NCCL (even chunks): ``reduce_scatter_tensor``, a ring. Otherwise the all-reduce cut to the
        chunk that gloo's own reduce_scatter_tensor is (Transport's default). Unmeasured on a GPU."""
        n = self.world_size
        if not (self._stream_ordered and tensor.numel() % n == 0):
            return super()._native_reduce_scatter(tensor)
        out = torch.empty(tensor.numel() // n, dtype=tensor.dtype, device=tensor.device)
        work = dist.reduce_scatter_tensor(out, tensor, group=self.group, async_op=True)
        moved = (tensor.numel() - out.numel()) * tensor.element_size()  # even chunks: sent = received
        return self._from_work(work, lambda _: (out, moved, moved, n - 1 if out.numel() else 0, 0))

    def _broadcast(self, tensor: torch.Tensor, src: int) -> Handle[torch.Tensor]:
        out = tensor.clone()
        work = dist.broadcast(out, src=self._global(src), group=self.group, async_op=True)
        return self._from_work(work, lambda _: out)

    def _send_recv(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> Handle[torch.Tensor | None]:
        return self._p2p(lambda: self._send_recv_now(tensor, dst, src, device))

    def _send_recv_now(
        self, tensor: torch.Tensor | None, dst: int | None, src: int | None, device: torch.device
    ) -> torch.Tensor | None:
        ops = []
        if tensor is not None and dst is not None:
            size = torch.tensor([tensor.numel()], dtype=torch.int64, device=tensor.device)
            ops.append(dist.P2POp(dist.isend, size, group=self.group, peer=self._global(dst)))
        recv_size = None
        if src is not None:
            recv_size = torch.empty(1, dtype=torch.int64, device=device)
            ops.append(dist.P2POp(dist.irecv, recv_size, group=self.group, peer=self._global(src)))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        ops = []
        if tensor is not None and dst is not None and tensor.numel():
            ops.append(dist.P2POp(dist.isend, tensor, group=self.group, peer=self._global(dst)))
        received = None
        if recv_size is not None and src is not None:
            received = torch.empty(int(recv_size.item()), dtype=torch.uint8, device=device)
            if received.numel():
                ops.append(dist.P2POp(dist.irecv, received, group=self.group, peer=self._global(src)))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    def _barrier(self) -> Handle[None]:
        work = dist.barrier(group=self.group, async_op=True)
        return self._from_work(work, lambda _: None)


_CREATED_GROUPS: list[dist.ProcessGroup] = []
"""Every group zensync created (``_new_group``), so none is destroyed on its own backend thread."""


def _destroy_created_groups() -> None:
    """At interpreter exit: destroy zensync's groups while the interpreter is still whole.

    Left to the interpreter's teardown, a gloo group is destroyed at some point of it, in any order
    with the default group and the threads around it, and a run then ended now and then in
    ``terminate called without an active exception`` (SIGABRT) after the program itself had
    finished. After the program destroyed the groups itself (``destroy_process_group()`` ends them
    all), the group objects zensync holds are kept from ever being freed instead (below).
    """
    if dist.is_available() and (dist.is_initialized() or _CREATED_GROUPS or _TRANSPORTS):
        _let_gloo_workers_release()
    if not dist.is_available() or not dist.is_initialized():
        # The program destroyed them (``destroy_process_group()`` shuts every group down), or never
        # initialized. What zensync still holds (its own groups, the default and DDP groups its
        # transports are keyed by, and the transports with their works) must then never be freed:
        # freed during the interpreter's teardown, a gloo group's threads want the GIL Python no
        # longer gives and exit mid C++ frame ("terminate called without an active exception",
        # SIGABRT: 3 of 8 torchrun exits of tests/distributed/hooks/test_torchrun.py's script);
        # freed here, the last reference can fall on a gloo worker thread that then joins itself
        # ("Resource deadlock avoided": 2 of 12). Their resources go with the process, which is
        # ending.
        held = [*_CREATED_GROUPS, *_TRANSPORTS, *_TRANSPORTS.values()]  # the transports hold their works too
        for obj in held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))  # one reference never released
        return
    groups, _CREATED_GROUPS[:] = list(_CREATED_GROUPS), []
    _TRANSPORTS.clear()
    for group in groups:
        try:
            dist.destroy_process_group(group)
        except Exception as exc:  # noqa: BLE001 - at exit: a group torch no longer knows is already gone
            logger.debug("zensync: group not destroyed at exit: %s", exc)


EXIT_GRACE_S = 0.05
"""How long the interpreter's exit gives gloo's worker threads the GIL (``_let_gloo_workers_release``)."""


def _let_gloo_workers_release() -> None:
    """Release the GIL for ``EXIT_GRACE_S`` so gloo's workers drop their last collectives' tensors.

    A gloo worker thread (``ProcessGroupGloo::runLoop``) drops its reference to a work after it
    marked it complete, so the program's ``wait()`` can return first and the worker's reference be
    the last one: freeing the work's tensors then takes the GIL on that thread. The program's
    thread holds the GIL until it releases it; a program that ends right after its last collective
    goes into the interpreter's teardown first, and the worker, still waiting for the GIL, exits
    mid C++ frame: "terminate called without an active exception", SIGABRT after the program
    finished. torch's FSDP2 alone on gloo does it (5 of 24 torchrun exits of a 2-rank
    ``fully_shard`` script, with or without ``destroy_process_group()``; 0 of 40 with this pause).
    """
    time.sleep(EXIT_GRACE_S)


atexit.register(_destroy_created_groups)

_TRANSPORTS: dict[object, TorchTransport] = {}


def transport_for_group(group: dist.ProcessGroup | None) -> TorchTransport:
    """The cached transport of ``group`` (None = the default group), created on first use.

    Caching keeps per-group state that must survive across calls, such as Zen's agreed hash seed.
    """
    key = group if group is not None else dist.group.WORLD
    transport = _TRANSPORTS.get(key)
    if transport is None:
        transport = _TRANSPORTS[key] = TorchTransport(group)
    return transport
