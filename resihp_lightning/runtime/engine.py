"""Building and destroying DeepSpeed pipeline engines inside a running job."""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from resihp_lightning._logging import get_logger

log = get_logger(__name__)

_comm_ready = False


class _OncePerProcess(logging.Filter):
    """Lets each distinct DeepSpeed warning through once: engines are rebuilt on every re-plan, and
    DeepSpeed repeats its configuration warnings (e.g. on bf16 gradient accumulation) at each build."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self._seen:
            return False
        self._seen.add(message)
        return True


def init_deepspeed_comm(backend: str) -> None:
    """Points ``deepspeed.comm`` at the current default process group (again after a regroup reset it).

    DeepSpeed's torch backend JIT-compiles a shared-memory op with g++ (tens of seconds) that only inference
    uses; it is skipped. The module must be patched through ``importlib`` (``import a.b.c as m``
    would bind the ``torch`` attribute deepspeed.comm re-exports, not the submodule).
    """
    global _comm_ready
    import deepspeed

    if _comm_ready and importlib.import_module("deepspeed.comm.comm").cdb is not None:
        return
    if not _comm_ready:
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        for name in ("DeepSpeed", "deepspeed"):
            logging.getLogger(name).setLevel(logging.WARNING)
            logging.getLogger(name).addFilter(_OncePerProcess())
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    _comm_ready = True


def engine_config(
    micro_batch_size: int, micro_batches: int, data_degree: int, overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """The DeepSpeed config of one rank: its replica runs ``micro_batches`` per step.

    ``gradient_accumulation_steps`` is per rank (the replica's m_r); DeepSpeed only checks that the
    batch arithmetic is consistent on each rank.
    """
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batch_size * micro_batches * data_degree,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    config.update(copy.deepcopy(dict(overrides)))
    return config


def build_engine(
    pipe: torch.nn.Module, optimizer: Optimizer | None, config: Mapping[str, Any], broadcast: bool = True
) -> Any:
    """Wraps ``pipe`` (a ``PipelineModule``) in a ``PipelineEngine`` that steps ``optimizer``.

    The optimizer object is kept: DeepSpeed drops empty parameter groups from it, so its full list
    of groups is put back afterwards (LR schedulers index groups by position).

    Args:
        broadcast: let DeepSpeed broadcast every parameter from the first replica (needed at the start,
            when replicas may have built layers with different random values; after a migration every
            replica already holds identical values, and the broadcast would send the whole model).
    """
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    groups = list(optimizer.param_groups) if optimizer is not None else None
    original = DeepSpeedEngine._broadcast_model
    if not broadcast:
        DeepSpeedEngine._broadcast_model = lambda self: None
    try:
        with _no_memory_reports():
            engine, _, _, _ = deepspeed.initialize(model=pipe, optimizer=optimizer, config=dict(config))
    finally:
        DeepSpeedEngine._broadcast_model = original
    if optimizer is not None and engine.optimizer is optimizer:
        optimizer.param_groups[:] = groups
    return engine


@contextlib.contextmanager
def _no_memory_reports() -> Iterator[None]:
    """Silences DeepSpeed's forced memory reports while an engine is built.

    ``BF16_Optimizer.__init__`` calls ``see_memory_usage(..., force=True)`` four times; each runs
    ``gc.collect()`` and prints; with Lightning loaded that is nearly all of a bf16 engine build, and so
    of a re-plan's rebuild time, for diagnostics nobody reads (``benchmarks/README.md`` has the numbers).
    """
    module = importlib.import_module("deepspeed.runtime.bf16_optimizer")
    saved = module.see_memory_usage
    module.see_memory_usage = lambda *args, **kwargs: None
    try:
        yield
    finally:
        module.see_memory_usage = saved


def set_micro_batches(engine: Any, micro_batches: int) -> None:
    """Changes the replica's micro-batch count of a live engine (no rebuild needed)."""
    data_degree = engine.grid.data_parallel_size
    engine.set_train_batch_size(engine.micro_batch_size * micro_batches * data_degree)


def destroy_engine(engine: Any) -> None:
    """Releases the process groups DeepSpeed created for ``engine`` (they are per topology).

    A DeepSpeed optimizer wrapper (ZeRO-1 / bf16) is detached from the parameters first: reused layers
    would otherwise keep its gradient hooks.
    """
    from resihp_lightning.state.wrapped_state import release

    release(engine)
    pipe = engine.module
    grid = pipe._grid
    seen: set[int] = set()
    candidates = [
        getattr(pipe, "world_group", None),
        getattr(grid, "ds_model_proc_group", None),
        getattr(grid, "dp_proc_group", None),
        getattr(grid, "pp_proc_group", None),
        getattr(grid, "slice_proc_group", None),
    ]
    for group in candidates:
        if group is None or id(group) in seen or group is dist.GroupMember.WORLD:
            continue
        seen.add(id(group))
        if not isinstance(group, dist.ProcessGroup):
            continue
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError) as err:  # already gone / not a member
            log.debug("could not destroy a DeepSpeed group: %s", err)
    engine.optimizer = None
    engine.basic_optimizer = None


def abandon_engine(engine: Any) -> None:
    """Lets go of an engine whose process groups died with a peer: no collective, no group destroyed.

    The groups belong to a generation that the resilience layer tears down as a whole; a DeepSpeed
    optimizer wrapper is still detached from the parameters (local work only).
    """
    from resihp_lightning.state.wrapped_state import release

    release(engine)
    engine.optimizer = None
    engine.basic_optimizer = None
