"""The benchmark's own process group: choices are timed on it, never on the user's.

Timing bounds every wait by ``collective_benchmark_timeout``. Timed on the user's group,
a choice that hangs would leave that group's communicator with a timed-out collective
(gloo closes its connections; NCCL's watchdog reports the group and, with
TORCH_NCCL_ASYNC_ERROR_HANDLING, tears it down), and lowering that group's timeout
changes what the user set. So every rank of a group times on a *timing group* of the
same ranks whose own timeout is the benchmark's. It is built from backends of the
group's kinds over the c10d Store, not with ``dist.new_group``, which advances c10d's
group counter on the group's ranks alone (later groups of the job would get other names
on other ranks). It is kept per group and timeout, under a *generation* that names its
rendezvous in the Store; a failed benchmark discards it on the rank that failed (on
NCCL aborting its communicator, which frees a kernel still waiting for a peer). Ranks
may so hold different generations, or one may hold half of a group its peers failed to
join: the benchmark agrees on the generation in the Store before every use
(collective_benchmarking), and all its ranks make a new one together where they differ.

Compiled choices reach it by name: a choice built for the benchmark passes
:func:`timing_name` of its group, which names the group itself until the group's first
benchmark and its timing group from then on.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from .collective_protocol import attempt_namespace

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


log = logging.getLogger(__name__)

_SUFFIX = ":collective_timing"
# An NCCL timing group's own timeout, in benchmark timeouts: the benchmark's deadline
# on the host ends a wait first, and aborts the communicator itself.
_NCCL_TIMEOUTS = 2


@dataclasses.dataclass(frozen=True)
class _Held:
    """A group, the timing group this rank made for it and that one's generation."""

    group: ProcessGroup
    timing: ProcessGroup
    generation: int


# By (group name, timeout): what this rank holds, and the newest generation it made (a
# discarded one's rendezvous keys stay in the Store; a new one must not meet them).
_held: dict[tuple[str, float], _Held] = {}
_newest: dict[tuple[str, float], int] = {}


def timing_name(group_name: str) -> str:
    """The name a choice compiled for the benchmark passes for ``group_name``; the
    name itself where this rank knows no such group."""
    name = group_name + _SUFFIX
    if _registered(name) is None:
        group = _registered(group_name)
        if group is None:
            return group_name
        _point(name, group)
    return name


def has_timing_group(group: ProcessGroup) -> bool:
    """Whether ``group``'s collectives are timed on a timing group: its backends are
    gloo or NCCL (the same answer on every rank of it)."""
    import torch.distributed as dist

    for device in group._device_types:
        backend = group._get_backend(device)
        gloo = isinstance(backend, dist.ProcessGroupGloo)
        nccl = dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL)
        if not (gloo or nccl):
            log.warning(
                "group %s has a %s backend for %s: collective choices are timed on "
                "the group itself",
                group.group_name,
                type(backend).__name__,
                device,
            )
            return False
    return True


@dataclasses.dataclass(frozen=True)
class Generations:
    """What one rank says of its timing groups for a group: the generation it holds
    (None: none) and the newest it made (-1: none)."""

    held: int | None
    newest: int


def generations(group: ProcessGroup, timeout: float) -> Generations:
    key = (group.group_name, timeout)
    held = _held.get(key)
    return Generations(
        held.generation if held is not None and held.group is group else None,
        _newest.get(key, -1),
    )


def timing_group(group: ProcessGroup, timeout: float, generation: int) -> ProcessGroup:
    """The timing group of ``group`` of ``generation``: the one held, else made now,
    collectively (every rank of ``group`` calls this with the same ``generation``).
    Raises where the rendezvous or the connection failed on this rank."""
    key = (group.group_name, timeout)
    held = _held.get(key)
    if held is None or held.group is not group or held.generation != generation:
        discard(group, timeout)
        _newest[key] = max(generation, _newest.get(key, -1))
        held = _Held(group, _made(group, timeout, generation), generation)
        _held[key] = held
    _point(group.group_name + _SUFFIX, held.timing)
    return held.timing


def discard(group: ProcessGroup, timeout: float) -> None:
    """Forget ``group``'s timing group after a failed benchmark: its collectives may
    have timed out. An NCCL one's communicator is aborted."""
    import torch.distributed as dist

    held = _held.pop((group.group_name, timeout), None)
    if held is None:
        return
    _point(group.group_name + _SUFFIX, group)
    for device in held.timing._device_types:
        backend = held.timing._get_backend(device)
        if dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL):
            backend.abort()


def _made(group: ProcessGroup, timeout: float, generation: int) -> ProcessGroup:
    """A new group of ``group``'s ranks and backend kinds (gloo, NCCL) with the
    benchmark's ``timeout``."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup as CProcessGroup

    backend_type = CProcessGroup.BackendType
    store = dist.PrefixStore(
        f"{attempt_namespace()}/timing/{group.group_name}/{timeout:g}/{generation}/",
        dist.distributed_c10d._get_default_store(),
    )
    rank, size = group.rank(), group.size()
    timing = CProcessGroup(store, rank, size)
    kinds = []
    for device in group._device_types:
        backend = group._get_backend(device)
        device_store = dist.PrefixStore(f"{device.type}/", store)
        if isinstance(backend, dist.ProcessGroupGloo):
            kind = backend_type.GLOO
            # On the group's own devices: their listeners are up and connected.
            options = dist.ProcessGroupGloo._Options()
            options._devices = backend.options._devices
            options._threads = backend.options._threads
            options._timeout = timedelta(seconds=timeout)
            made = dist.ProcessGroupGloo(device_store, rank, size, options)
        else:  # NCCL (has_timing_group)
            kind = backend_type.NCCL
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=_NCCL_TIMEOUTS * timeout)
            made = dist.ProcessGroupNCCL(device_store, rank, size, options)
        timing._register_backend(device, kind, made)
        kinds.append(kind)
    # As a group of several backends: NCCL where the group has it.
    timing._set_default_backend(
        backend_type.NCCL if backend_type.NCCL in kinds else kinds[0]
    )
    timing._set_group_name(group.group_name + _SUFFIX)
    log.debug(
        "timing group of %s made (ranks %d, timeout %g s, generation %d)",
        group.group_name,
        size,
        timeout,
        generation,
    )
    return timing


def _registered(name: str) -> ProcessGroup | None:
    """The group c10d's registry holds under ``name`` (emptied with the job's
    groups by destroy_process_group), or None."""
    try:
        return torch._C._distributed_c10d._resolve_process_group(name)
    except RuntimeError:  # c10d knows no such name
        return None


def _point(name: str, group: ProcessGroup) -> None:
    """Make ``name`` resolve to ``group`` in c10d's registry of group names."""
    from torch._C._distributed_c10d import (
        _register_process_group,
        _unregister_process_group,
    )

    if _registered(name) is not None:
        _unregister_process_group(name)
    _register_process_group(name, group)
