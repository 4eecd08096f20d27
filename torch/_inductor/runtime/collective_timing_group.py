"""The benchmark's own process group: choices are timed on it, never on the user's.

Timing bounds every wait by ``collective_benchmark_timeout``. Timed on the user's group,
a choice that hangs would leave that group's communicator with a timed-out collective
(gloo closes its connections; NCCL's watchdog reports the group and, with
TORCH_NCCL_ASYNC_ERROR_HANDLING, tears it down), and lowering that group's timeout
changes what the user set. So every rank of a group times on a *timing group* of the
same ranks whose own timeout is the benchmark's. It is built from backends of the
group's kinds over the c10d Store, not with ``dist.new_group``, which advances c10d's
group counter on the group's ranks alone (later groups of the job would get other names
on other ranks). It is made at the group's first benchmark, where all its ranks are,
once per group, timeout and job attempt, and kept; a failed benchmark discards it (on
NCCL aborting its communicator, which frees a kernel still waiting for a peer).

Compiled choices reach it by name: a choice built for the benchmark passes
:func:`timing_name` of its group, which names the group itself until the group's first
benchmark and its timing group from then on.
"""

from __future__ import annotations

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

# By (group name, timeout): the group and the timing group made for it, and how many
# were discarded (a name a new job in this process gives another group is made anew).
_timing_groups: dict[tuple[str, float], tuple[ProcessGroup, ProcessGroup]] = {}
_discarded: dict[tuple[str, float], int] = {}


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


def timing_group(group: ProcessGroup, timeout: float) -> ProcessGroup:
    """The timing group of ``group`` (made now, collectively, at the first call of
    every rank of ``group``); ``group`` itself where its backends are neither gloo
    nor NCCL."""
    key = (group.group_name, timeout)
    if key not in _timing_groups or _timing_groups[key][0] is not group:
        made = _made(group, timeout, _discarded.get(key, 0))
        if made is None:
            return group
        _timing_groups[key] = (group, made)
    timing = _timing_groups[key][1]
    _point(group.group_name + _SUFFIX, timing)
    return timing


def discard(group: ProcessGroup, timeout: float) -> None:
    """Forget ``group``'s timing group after a failed benchmark: its collectives may
    have timed out. An NCCL one's communicator is aborted."""
    import torch.distributed as dist

    key = (group.group_name, timeout)
    made = _timing_groups.pop(key, None)
    if made is None:
        return
    timing = made[1]
    _discarded[key] = _discarded.get(key, 0) + 1
    _point(group.group_name + _SUFFIX, group)
    for device in timing._device_types:
        backend = timing._get_backend(device)
        if dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL):
            backend.abort()


def _made(group: ProcessGroup, timeout: float, generation: int) -> ProcessGroup | None:
    """A new group of ``group``'s ranks and backend kinds with the benchmark's
    ``timeout``; None for other backends than gloo and NCCL."""
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
        elif dist.is_nccl_available() and isinstance(backend, dist.ProcessGroupNCCL):
            kind = backend_type.NCCL
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=_NCCL_TIMEOUTS * timeout)
            made = dist.ProcessGroupNCCL(device_store, rank, size, options)
        else:
            log.warning(
                "group %s has a %s backend for %s: collective choices are timed on "
                "the group itself",
                group.group_name,
                type(backend).__name__,
                device,
            )
            return None
        timing._register_backend(device, kind, made)
        kinds.append(kind)
    # As a group of several backends: NCCL where the group has it.
    timing._set_default_backend(
        backend_type.NCCL if backend_type.NCCL in kinds else kinds[0]
    )
    timing._set_group_name(group.group_name + _SUFFIX)
    log.debug(
        "timing group of %s made (ranks %d, timeout %g s)",
        group.group_name,
        size,
        timeout,
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
