"""``zensync.register_fsdp(model)``: FSDP2's gradient reduce-scatter through zensync, one line.

For a model wrapped by ``fully_shard``, every FSDP module's reduce-scatter (``zensync.transport.fsdp``)
goes through ``FSDPSyncState.reduce_scatter``, which syncs each parameter's segment by one of three
paths, the same on every rank (the layout and the strategy are agreed at registration):

    rows        row-sparse gradients (embeddings; ``sparse_params``): each rank pushes its non-zero
                rows to the owner of their FSDP shard (``zensync.sync.row_reduce_scatter``); lossless
    compress    the strategy's compressor (or a plan's, per parameter): one all-to-all of compressed
                chunks with error feedback (``zensync.compress.collectives.reduce_scatter``)
    dense       the bandwidth-correct reduce-scatter (``Transport.reduce_scatter``: a ring of
                point-to-point steps on gloo, whose own reduce-scatter is an all-reduce, twice the bytes)

Strategies, as for DDP (``zensync.register``): "dense"; "auto" or a sparse scheme name ("zen", ...):
rows for the row-sparse parameters, dense for the rest (lossless); a compressor spec ("fp16",
"qsgd:127", "topk:0.01"): rows for the row-sparse parameters, the compressor for the rest; a plan file
from ``zensync plan``: each parameter's compressor by name (dense where the plan has none). The op
FSDP asks for (sum, average, or its gradient divide factor) scales the summed shard.

The ranks agree at registration (``zensync.sync.registration.agree``): a rank whose options, model or
strategy fail its local checks fails every rank with the same ValueError quoting it, and ranks that
differ are named, instead of hanging in the first reduce-scatter.

``state_dict()`` / ``load_state_dict()`` checkpoint what a step hands the next (error-feedback
residuals, PowerSGD's Qs, Zen's seed, the decisions, the step) through torch.distributed.checkpoint,
resharded to another world or mesh (``zensync.hooks.fsdp_checkpoint``).

Example::

    fully_shard(model.layers[0])
    fully_shard(model)
    state = zensync.register_fsdp(model, strategy="auto")
    loss.backward()  # the embedding's non-zero rows go to their owners; the rest, ring reduce-scatter
    state.last_step()  # per parameter: path, bytes sent, rows per owner
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
from typing import Any

import torch

from zensync.compress import COMPRESSED_SCHEMES, Compressor, build
from zensync.compress.collectives.reduce_scatter import compressed_reduce_scatter
from zensync.compress.error_feedback import ErrorFeedback
from zensync.hooks.config import HookConfig, check_options
from zensync.hooks.fsdp_replica import ReplicaSync, matrix_shape
from zensync.hooks.hints import EMBEDDING_MODULES
from zensync.hooks.state import SyncListener, SyncListeners
from zensync.hooks.strategy import Strategy, resolve_strategy
from zensync.sync import SCHEMES, SyncOptions
from zensync.sync.registration import agree
from zensync.sync.row_reduce_scatter import row_reduce_scatter
from zensync.transport import Transport, transport_for_group
from zensync.transport.fsdp import (
    FSDPGroup,
    ReduceScatterCall,
    Segment,
    broadcast_shards,
    fsdp_groups,
    gather_segments,
    replicate_group,
    scatter_segments,
)

__all__ = ["FSDPConfig", "FSDPSyncState", "Path", "register_fsdp"]

logger = logging.getLogger(__name__)


class Path(enum.Enum):
    """How one parameter's segment is reduce-scattered."""

    DENSE = "dense"
    ROWS = "rows"
    COMPRESS = "compress"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FSDPConfig:
    """``register_fsdp``'s options."""

    strategy: str = "auto"
    """See the module docstring."""
    sparse_params: tuple[str, ...] = ()
    """Names of parameters to sync as row-sparse besides the weights of nn.Embedding / nn.EmbeddingBag."""
    dense_params: tuple[str, ...] = ()
    """Names of parameters always synced dense (an embedding whose every row is touched each step)."""
    error_feedback: bool = True
    """Keep what compression dropped and add it back at the next step (EF-SGD)."""
    compressed_scheme: str = "auto"
    """HSDP: the collective of the compressed replica sync ("auto", "allreduce", "allgather", ...)."""
    sync_options: SyncOptions = dataclasses.field(default_factory=SyncOptions)
    """HSDP: tunables of the sparse scheme of the replica sync (``zensync.SyncOptions``)."""
    history_size: int = 1000
    """Step records kept in ``FSDPSyncState.history`` (oldest dropped)."""
    jsonl_path: str | None = None
    """Append one JSON line per finished step here; '{rank}' in the path gives one file per rank, else rank 0 writes."""

    def __post_init__(self) -> None:
        for field in ("sparse_params", "dense_params"):
            value = getattr(self, field)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{field}={value!r} must be a sequence of parameter names")
            object.__setattr__(self, field, tuple(value))
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback={self.error_feedback!r} must be True or False")
        if self.compressed_scheme not in ("auto", *COMPRESSED_SCHEMES):
            raise ValueError(
                f"compressed_scheme={self.compressed_scheme!r} is not one of auto, {', '.join(COMPRESSED_SCHEMES)}"
            )
        if not isinstance(self.sync_options, SyncOptions):
            raise ValueError(f"sync_options={self.sync_options!r} must be a zensync.SyncOptions")
        if isinstance(self.history_size, bool) or not isinstance(self.history_size, int) or self.history_size < 1:
            raise ValueError(f"history_size={self.history_size!r} must be an int >= 1")
        if self.jsonl_path is not None and not isinstance(self.jsonl_path, str):
            raise ValueError(f"jsonl_path={self.jsonl_path!r} must be a path string or None")

    @classmethod
    def from_options(cls, strategy: str, options: dict[str, Any]) -> FSDPConfig:
        """Build from ``register_fsdp``'s keyword options, naming any unknown option.

        Raises:
            ValueError: For an option of ``register`` (DDP) that FSDP's sync does not take, saying why,
                and for any other unknown option.
        """
        ddp_only = sorted(
            set(options) & {f.name for f in dataclasses.fields(HookConfig)} - {f.name for f in dataclasses.fields(cls)}
        )
        if ddp_only:
            raise ValueError(
                f"zensync.register_fsdp does not take {ddp_only}, options of zensync.register (DDP): FSDP's paths "
                f"are fixed at registration (no adaptive scheme choice, warm-up or profile: auto is lossless, a "
                f"compressor comes from a spec or a plan file), and FSDP's own groups carry init_process_group's "
                f"timeout (zensync creates none); its options: "
                f"{', '.join(f.name for f in dataclasses.fields(cls) if f.name != 'strategy')}"
            )
        check_options(cls, options, "zensync.register_fsdp")
        return cls(strategy=strategy, **options)


@dataclasses.dataclass(frozen=True, slots=True)
class Binding:
    """The model a state serves: its parameters and their segments by name, FSDP's group."""

    segments: dict[str, Segment]
    params: dict[str, torch.Tensor]
    """The sharded parameters (DTensors) by fully-qualified name."""
    process_group: Any
    transport: Transport
    """FSDP's group's transport (the shard dimension)."""

    @classmethod
    def of(cls, model: torch.nn.Module, groups: list[FSDPGroup]) -> Binding:
        segments = {s.name: s for g in groups for s in g.layout()}
        group = groups[0].process_group
        return cls(segments, dict(model.named_parameters()), group, transport_for_group(group))


@dataclasses.dataclass(frozen=True, slots=True)
class SegmentPlan:
    """One parameter's paths: in the reduce-scatter, and over the replicas (HSDP)."""

    path: Path
    replica: Path
    spec: str | None = None
    """The compressor of the compress path."""


class FSDPSyncState:
    """zensync's side of an FSDP model: the configuration, each parameter's path, the error-feedback
    memory and the per-step records. Built by ``register_fsdp``."""

    def __init__(
        self,
        config: FSDPConfig,
        strategy: Strategy,
        row_sparse: frozenset[str],
        binding: Binding,
        replicas: ReplicaSync | None = None,
    ) -> None:
        # configuration
        self.config, self.strategy, self._row_sparse = config, strategy, row_sparse
        self.binding = binding
        self.replicas = replicas
        """HSDP: the replica sync after each reduce-scatter (None: FSDP alone)."""
        self._compressors: dict[str, Compressor] = {}
        self._plans: dict[str, SegmentPlan] = {}
        # memory
        self.memory = ErrorFeedback()
        self._owed: dict[str, torch.Tensor] = {}
        """Per compressed parameter, what this rank owes its gradient (float32, gradient units, its
        padded chunk) from a checkpoint or a save, until its next compression makes it a residual."""
        self._units: dict[str, float] = {}
        """Per compressed parameter (FSDP alone), the op's factor at its last reduce-scatter."""
        # log: one record per step, a step being the reduce-scatters of one backward (closed at its end)
        self.step = 0
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=config.history_size)
        self._open: dict[str, Any] = {}
        self._end_queued = False
        self._sync_listeners = SyncListeners()
        path, rank = config.jsonl_path, binding.transport.rank
        self._jsonl = path.format(rank=rank) if path and "{rank}" in path else path if rank == 0 else None

    def plan_for(self, segment: Segment) -> SegmentPlan:
        """The path of ``segment``'s parameter (the same on every rank: it depends on agreed data only)."""
        plan = self._plans.get(segment.name)
        if plan is None:
            plan = self._plans[segment.name] = self._decide(segment)
        return plan

    def _decide(self, segment: Segment) -> SegmentPlan:
        """Row-sparse parameters take the rows path; others the strategy's (or plan's) compressor, or
        dense. With replicas (HSDP) the reduce-scatter, inside a node, stays lossless and the
        compressor serves the replica sync, across nodes."""
        kind, spec = self._kind(segment)
        if self.replicas is None:
            return SegmentPlan(kind, kind, spec)
        return SegmentPlan(Path.ROWS if kind is Path.ROWS else Path.DENSE, kind, spec)

    def _kind(self, segment: Segment) -> tuple[Path, str | None]:
        name, strategy = segment.name, self.strategy
        if strategy.kind == "dense" or name in self.config.dense_params:
            return Path.DENSE, None
        if segment.rows and name in self._row_sparse:
            return Path.ROWS, None
        if strategy.kind == "compress" and strategy.compressor is not None:
            return Path.COMPRESS, strategy.compressor
        if strategy.kind == "plan" and strategy.plan is not None and strategy.plan.has(name):
            compression = strategy.plan.compression_for(name)
            if compression is not None:
                return Path.COMPRESS, compression[0]
        return Path.DENSE, None

    def reduce_scatter(self, call: ReduceScatterCall) -> None:
        """One FSDP reduce-scatter: the dense segments in one ring reduce-scatter, then each row-sparse
        and each compressed segment on its own; every rank in the same order."""
        if call.module in self._open:  # the module's second call: a new step began (its backward's end unseen)
            self._close_step()
        if not self._open:
            self._sync_listeners.begins()
            if not self._end_queued:
                self._queue_end_of_backward()
        plans = [self.plan_for(s) for s in call.segments]
        records: dict[str, dict[str, Any]] = {}
        dense = [s for s, p in zip(call.segments, plans, strict=True) if p.path is Path.DENSE]
        if dense:
            self._dense(call, dense, records)
        for segment, plan in zip(call.segments, plans, strict=True):
            if plan.path is Path.ROWS:
                self._rows(call, segment, records)
            elif plan.path is Path.COMPRESS:
                assert plan.spec is not None
                self._compressed(call, segment, plan.spec, records)
        if call.scale != 1.0:
            call.output.mul_(call.scale)
        if self.replicas is not None:
            self._sync_replicas(self.replicas, call, plans, records)
        self._open[call.module] = records

    # -- checkpoints (zensync.hooks.fsdp_checkpoint) -----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals, PowerSGD's Qs, Zen's seed, the decisions and the step, in a form
        ``torch.distributed.checkpoint`` saves and reshards (``zensync.hooks.fsdp_checkpoint``).
        A collective: call it on every rank, between steps."""
        from zensync.hooks.fsdp_checkpoint import save

        return save(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict`` (DCP-loaded, on this world or another), between steps, on every rank."""
        from zensync.hooks.fsdp_checkpoint import load

        load(self, state)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's state as it is (residuals, Qs, seed, step: plain tensors and JSON values), for a
        checkpoint restored by the same rank of the same world (zensync's in-memory checkpoints take
        it: ``resilience.memory.state_of``). No collective; the live state is not changed."""
        from zensync.hooks.fsdp_checkpoint import local

        return local(self)

    def load_local_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``local_state_dict`` (same world, same rank), between steps."""
        from zensync.hooks.fsdp_checkpoint import load_local

        load_local(self, state)

    @property
    def next_step(self) -> int:
        """The number the next backward's step takes."""
        return self.step + 1 if self._open else self.step

    def restart(self, step: int, owed: dict[str, torch.Tensor]) -> None:
        """Go on at ``step`` owing ``owed`` (``fsdp_checkpoint``)."""
        if step != self.next_step:
            self.step, self._open = step, {}
        self._owed = dict(owed)

    def owed(self, name: str) -> torch.Tensor | None:
        """What this rank owes ``name``'s gradient and has not made a residual yet (``_owed``)."""
        return self._owed.get(name)

    def unit(self, name: str) -> float:
        """The factor from ``name``'s reduce-scatter sum to its gradient (FSDP alone; 1 before any call)."""
        return self._units.get(name, 1.0)

    def _sync_replicas(
        self, replicas: ReplicaSync, call: ReduceScatterCall, plans: list[SegmentPlan], records: dict[str, Any]
    ) -> None:
        """HSDP: the shard summed over the replicas, every rank in the same order (``fsdp_replica``)."""
        pairs = list(zip(call.segments, plans, strict=True))
        dense = [s for s, p in pairs if p.replica is Path.DENSE]
        replicas.dense(call.output, dense)
        for segment in dense:
            records[segment.name]["replica_bytes"] = replicas.dense_bytes(segment.numel * call.output.element_size())
        for segment, plan in pairs:
            if plan.replica is Path.ROWS:
                stats = replicas.rows(call.output, segment)
                records[segment.name].update(
                    replica_scheme=stats.scheme,
                    replica_bytes=stats.bytes_sent,
                    replica_rows=stats.local_nnz,
                    replica_union=stats.global_nnz,
                )
            elif plan.replica is Path.COMPRESS:
                assert plan.spec is not None
                owed = self._owed.pop(segment.name, None)
                if owed is not None and replicas.transport.rank == 0:  # the first replica keeps what is owed
                    residual = (owed / replicas.unit).to(call.output.dtype).view(matrix_shape(segment))
                    replicas.sync_for(plan.spec).worker_memory.replace(segment.name, residual)
                records[segment.name]["replica_bytes"] = replicas.compressed(call.output, segment, plan.spec, self.step)
            records[segment.name]["replica"] = plan.replica.value
        replicas.finish(call.output)

    def _dense(self, call: ReduceScatterCall, segments: list[Segment], records: dict[str, dict[str, Any]]) -> None:
        n = call.transport.world_size
        shard = call.transport.reduce_scatter(gather_segments(call.input, segments).reshape(-1))
        scatter_segments(shard, call.output, segments)
        for s in segments:
            records[s.name] = {"path": "dense", "bytes_sent": (n - 1) * s.numel * call.input.element_size()}

    def _rows(self, call: ReduceScatterCall, segment: Segment, records: dict[str, dict[str, Any]]) -> None:
        x = call.input[:, segment.offset : segment.offset + segment.numel]
        result = row_reduce_scatter(x.reshape(-1, segment.rows, segment.width), call.transport)
        call.output[segment.offset : segment.offset + segment.numel].copy_(result.out.reshape(-1))
        records[segment.name] = {
            "path": "rows",
            "bytes_sent": result.bytes_sent,
            "rows_sent": list(result.rows_sent),
            "rows_received": sum(result.rows_received),
        }

    def _compressed(
        self, call: ReduceScatterCall, segment: Segment, spec: str, records: dict[str, dict[str, Any]]
    ) -> None:
        compressor = self.compressor_for(spec)
        x = call.input[:, segment.offset : segment.offset + segment.numel]
        memory = self.memory if self.config.error_feedback else None
        self._units[segment.name] = call.scale
        owed = self._owed.pop(segment.name, None)
        if owed is not None and memory is not None:
            residual = torch.zeros_like(x)
            residual[call.transport.rank] = owed / call.scale
            memory.replace(segment.name, residual)
        shape = matrix_shape(segment)
        out = compressed_reduce_scatter(
            x, call.transport, compressor, memory, name=segment.name, step=self.step, chunk_shape=shape
        )
        call.output[segment.offset : segment.offset + segment.numel].copy_(out)
        n = call.transport.world_size
        records[segment.name] = {
            "path": "compress",
            "spec": spec,
            "bytes_sent": (n - 1) * compressor.shaped_payload_bytes(shape, x.dtype),
        }

    def compressor_for(self, spec: str) -> Compressor:
        """The compressor of ``spec`` in the reduce-scatter (with its state: PowerSGD's Qs)."""
        compressor = self._compressors.get(spec)
        if compressor is None:
            compressor = self._compressors[spec] = build(spec)
        return compressor

    def _open_record(self) -> dict[str, Any]:
        """The step in progress: every module's records so far, by parameter name."""
        params: dict[str, Any] = {}
        for records in self._open.values():
            params.update(records)
        return {"step": self.step, "params": params}

    def _queue_end_of_backward(self) -> None:
        """Close the step when the backward that began it ends (autograd's final callback, as FSDP's own)."""
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        except RuntimeError:  # not inside a backward: the module's next call closes the step
            return
        self._end_queued = True

    def _end_of_backward(self) -> None:
        self._end_queued = False
        if self._open:
            self._close_step()

    def _close_step(self) -> None:
        record = self._open_record()
        self.history.append(record)
        if self._jsonl is not None:
            with open(self._jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")
        self._open = {}
        self.step += 1
        self._sync_listeners.ends()

    def add_sync_listener(self, listener: SyncListener) -> None:
        """Tell ``listener`` when each step's reduce-scatters begin (the first) and end (the backward's
        end): the network's idle windows lie between (``zensync.resilience`` sends there), as
        ``ZenSyncState.add_sync_listener`` tells for DDP."""
        self._sync_listeners.add(listener)

    def last_step(self) -> dict[str, Any] | None:
        """The records of the step in progress or just finished (None before the first reduce-scatter)."""
        if self._open:
            return self._open_record()
        return self.history[-1] if self.history else None

    def describe(self) -> str:
        """The configuration as text (compared across ranks at registration)."""
        return json.dumps(
            {"config": dataclasses.asdict(self.config), "strategy": self.strategy.text,
             "digest": self.strategy.plan_digest, "row_sparse": sorted(self._row_sparse)},
            sort_keys=True,
        )  # fmt: skip


def register_fsdp(model: torch.nn.Module, strategy: str = "auto", mesh: Any = None, **options: Any) -> FSDPSyncState:
    """Route the reduce-scatters of a ``fully_shard`` model through zensync; returns the state.

    Args:
        model: The root module, wrapped by ``fully_shard`` (its submodules may be too).
        strategy: "auto", "dense", a sparse scheme name, a compressor spec or a plan file (module docstring).
        mesh: For HSDP, the 2-D (replicate, shard) DeviceMesh, the model being sharded on
            ``mesh["shard"]``: zensync then syncs the replicas (``zensync.hooks.fsdp_replica``) and
            sets every replica's shards to the first replica's. None or a 1-D mesh: FSDP alone.
        **options: ``FSDPConfig`` fields (sparse_params, dense_params, error_feedback).

    Returns:
        The ``FSDPSyncState`` (``last_step()``, ``history``).

    Raises:
        ValueError: On every rank, when any rank's local checks fail (not an FSDP model, unknown
            options or strategy, a module FSDP cannot give a custom reduce-scatter) or ranks differ in
            their options or model.
    """
    # Step 1: local checks, no communication; a failure is carried to every rank by the agreement.
    failure: BaseException | None = None
    groups: list[FSDPGroup] = []
    state: FSDPSyncState | None = None
    try:
        groups = fsdp_groups(model)
        if not groups:
            raise ValueError(
                f"zensync.register_fsdp expects a model wrapped by torch.distributed.fsdp.fully_shard, got "
                f"{type(model).__name__} with no FSDP module holding parameters"
            )
        config = FSDPConfig.from_options(strategy, options)
        names = {name for name, _ in model.named_parameters()}
        unknown = sorted((set(config.sparse_params) | set(config.dense_params)) - names)
        if unknown:
            raise ValueError(f"sparse_params/dense_params name parameters the model does not have: {unknown}")
        resolved = resolve_strategy(strategy)
        replica_pg = _replicas(groups, mesh)
        replicas = None
        if replica_pg is not None:
            scheme = strategy if strategy in SCHEMES and strategy != "dense" else "zen"
            average = groups[0].divide_factor is None
            replicas = ReplicaSync(
                transport_for_group(replica_pg),
                scheme,
                average=average,
                compressed_scheme=config.compressed_scheme,
                sync_options=config.sync_options,
            )
        binding = Binding.of(model, groups)
        state = FSDPSyncState(config, resolved, _row_sparse_names(model, config), binding, replicas)
    except Exception as exc:  # noqa: BLE001 - carried to every rank and re-raised by the agreement
        failure = exc
    # Step 2: the agreement, over every rank of the mesh (FSDP's group, or the default group).
    transport = transport_for_group(None if mesh is not None or not groups else groups[0].process_group)
    description = _describe_model(model) + (state.describe() if state is not None else "")
    agree(transport, description, failure, seed=0, caller="zensync.register_fsdp")
    assert state is not None  # agree raised otherwise
    # Step 3: replicas start equal; every FSDP module's reduce-scatter goes through the state.
    if state.replicas is not None:
        broadcast_shards(model, replica_pg)
    for group in groups:
        group.install(state.reduce_scatter)
    logger.info("zensync.register_fsdp: %d FSDP modules, strategy %s", len(groups), strategy)
    return state


def _replicas(groups: list[FSDPGroup], mesh: Any) -> Any:
    """The replicate process group of an HSDP mesh (None: FSDP alone), after checking the model's sharding.

    Raises:
        ValueError: If an FSDP module is native HSDP (its replica all-reduce cannot be replaced), or
            the modules shard over different groups, or ``mesh`` does not fit them.
    """
    native = [g.name or "<root>" for g in groups if g.native_replicas]
    if native:
        raise ValueError(
            f"FSDP modules {native} were sharded on a 2-D mesh (native HSDP): FSDP all-reduces their shards "
            f"over replicas itself, and that all-reduce cannot be replaced; fully_shard them on mesh['shard'] "
            f"and pass the 2-D mesh as zensync.register_fsdp(model, mesh=mesh)"
        )
    return replicate_group(mesh, groups[0].process_group) if mesh is not None else None


def _row_sparse_names(model: torch.nn.Module, config: FSDPConfig) -> frozenset[str]:
    """The weights of the model's embeddings, plus ``config.sparse_params``."""
    names = set(config.sparse_params)
    for module_name, module in model.named_modules():
        if isinstance(module, EMBEDDING_MODULES):
            names.add(f"{module_name}.weight" if module_name else "weight")
    return frozenset(names)


def _describe_model(model: torch.nn.Module) -> str:
    """Parameter names, shapes and dtypes (their sharded local view is rank-dependent: use the global shape)."""
    rows = [f"{name}:{tuple(p.shape)}:{p.dtype}" for name, p in model.named_parameters()]
    return ";".join(rows)
