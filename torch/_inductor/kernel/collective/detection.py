"""Which calls communicate, and over which process group: by type and by value.

A call communicates when its op is a known collective (:data:`COLLECTIVE_OPS`), when it
passes a process group by type (a ``ProcessGroup`` script object), or when a string
argument through which ops name their group (:data:`GROUP_ARGUMENTS`) holds the name of
a group this rank knows. An int, or a string that names no group, never counts: a name
alone says nothing. An op whose own call names no group communicates when its choices'
traced graphs call a collective. :func:`synchronised_group` is the one rule for the
group such a call is tuned over.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch._ops import OpOverload, OpOverloadPacket
    from torch.distributed import ProcessGroup


log = logging.getLogger(__name__)


def _packets(namespace: str, names: str) -> frozenset[str]:
    return frozenset(f"{namespace}::{name}" for name in names.split())


# The ops that communicate, by OpOverloadPacket name (torch 2.11 to 2.14; none of them
# carries a tag that says so). Exact names (``aten::broadcast_to`` is none). Most also
# name their group by an argument; those that do not (symmetric memory's peer-to-peer
# ops) are known only here.
COLLECTIVE_OPS: frozenset[str] = (
    _packets(
        "_c10d_functional",
        """all_gather_into_tensor all_gather_into_tensor_coalesced
        all_gather_into_tensor_out all_reduce all_reduce_ all_reduce_coalesced
        all_reduce_coalesced_ all_to_all_single batch_p2p_ops broadcast broadcast_
        irecv isend reduce_scatter_tensor reduce_scatter_tensor_coalesced
        reduce_scatter_tensor_out""",
    )
    | _packets(
        "_c10d_functional_autograd",
        "all_gather_into_tensor all_reduce all_to_all_single reduce_scatter_tensor",
    )
    | _packets(
        "c10d",
        """_allgather_base_ _reduce_scatter_base_ allgather_ allgather_coalesced_
        allgather_into_tensor_coalesced_ allreduce_ allreduce_coalesced_ alltoall_
        alltoall_base_ barrier broadcast_ gather_ gather_into_tensor_
        monitored_barrier_ recv_ recv_any_source_ reduce_ reduce_scatter_
        reduce_scatter_tensor_coalesced_ scatter_ send""",
    )
    | _packets("_dtensor", "shard_dim_alltoall")
    | _packets(
        "symm_mem",
        """_async_input_mm _barrier _low_contention_all_gather
        _low_contention_all_gather_ce_multicast
        _low_contention_all_gather_ce_multicast_out _low_contention_reduce_scatter
        _rendezvous all_to_all_vdev all_to_all_vdev_2d all_to_all_vdev_2d_offset
        fused_all_gather_matmul fused_all_gather_scaled_matmul
        fused_matmul_reduce_scatter fused_scaled_matmul_reduce_scatter
        get_remote_tensors memcpy_to_multicast_ memset32_ multi_root_tile_reduce
        multimem_all_gather_out multimem_all_reduce_ multimem_one_shot_all_reduce
        multimem_one_shot_all_reduce_out multimem_one_shot_reduce_out
        nccl_all_to_all_nd nccl_get nccl_get_out nccl_put nccl_put_signal
        nccl_put_with_signal nccl_reduce_scatter_offset nccl_wait_for_signal
        nccl_wait_signal nvshmem_all_to_all nvshmem_broadcast nvshmem_get
        nvshmem_get_out nvshmem_put nvshmem_put_with_signal nvshmem_wait_for_signal
        one_shot_all_reduce one_shot_all_reduce_copy one_shot_all_reduce_copy_out
        one_shot_all_reduce_out reduce_scatter_out stream_write_value32_ tile_reduce
        two_shot_all_reduce_ two_shot_all_reduce_out""",
    )
)
_SYMMETRIC_MEMORY_NAMESPACE = "symm_mem"

# Arguments through which an op may name its process group by a string. A name alone
# never counts: the string must name a group this rank knows.
GROUP_ARGUMENTS = ("group_name", "group", "process_group", "pg")


def op_name(op: OpOverload) -> str:
    """An op's qualified name ("ns::name")."""
    return op.name() if hasattr(op, "name") and callable(op.name) else str(op)


def _packet_name(op: OpOverload | OpOverloadPacket | str) -> str:
    """The qualified name ("ns::name") of ``op``'s OpOverloadPacket."""
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}::{op._opname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    # "torch.ops.ns.name.overload", "ns::name" or "ns.name.overload"
    parts = str(op).removeprefix("torch.ops.").replace("::", ".").split(".")
    return "::".join(parts[:2])


def is_collective_op(op: OpOverload | OpOverloadPacket | str) -> bool:
    """Whether ``op`` (an OpOverload, its packet or its name) is a known collective;
    ``wait_tensor`` is none."""
    return _packet_name(op) in COLLECTIVE_OPS


def uses_symmetric_memory(op: OpOverload | OpOverloadPacket | str) -> bool:
    """Whether ``op`` needs its input in symmetric memory of its group."""
    namespace = _packet_name(op).partition("::")[0]
    return namespace == _SYMMETRIC_MEMORY_NAMESPACE


@functools.cache
def _process_group_type() -> Any:
    """The TorchScript type by which c10d's own ops take a ProcessGroup (None where
    torch has no distributed support)."""
    if not hasattr(torch.ops, "c10d") or not hasattr(torch.ops.c10d, "barrier"):
        return None
    schema = torch.ops.c10d.barrier.default._schema
    return next(a.type for a in schema.arguments if isinstance(a.type, torch.ClassType))


def _element_type(argument: Any) -> Any:
    kind = argument.type
    return kind.getElementType() if isinstance(kind, torch.OptionalType) else kind


def takes_group_by_type(argument: Any) -> bool:
    """Whether a schema ``argument`` is a ProcessGroup (or an optional one)."""
    expected = _process_group_type()
    return expected is not None and _element_type(argument) == expected


def _may_name_group(argument: Any) -> bool:
    """Whether a schema ``argument`` can carry a process group: by type, or among
    GROUP_ARGUMENTS as a string or anything (torch 2.13 on types the functional
    collectives' ``group_name`` so, to take a name or a group); its value decides."""
    return takes_group_by_type(argument) or (
        argument.name in GROUP_ARGUMENTS
        and isinstance(_element_type(argument), (torch.StringType, torch.AnyType))
    )


def _group_parameters(op: Any) -> list[Any]:
    schema = getattr(op, "_schema", None)
    if schema is None:
        return []
    return [a for a in schema.arguments if _may_name_group(a)]


def may_communicate(op: OpOverload) -> bool:
    """What an op's registration can tell before any call: whether ``op`` is a known
    collective or can name a process group (by type, or by a string whose value a call
    sets). Only a call tells whether a string names a group (:func:`named_groups`)."""
    return is_collective_op(op) or bool(_group_parameters(op))


@dataclasses.dataclass(frozen=True)
class NamedGroup:
    """An argument through which a call names a process group: the group it names,
    or None where this rank knows no group of that name."""

    argument: str
    value: Any
    group: ProcessGroup | None

    def describe(self) -> str:
        value = self.value if isinstance(self.value, str) else type(self.value)
        return f"{self.argument}={value!r}"


def named_groups(op: Any, arguments: Mapping[str, Any]) -> list[NamedGroup]:
    """The arguments (by name) of a call of ``op`` that can carry a process group, each
    with the group it names; a string that names none has ``group`` None."""
    found = []
    for parameter in _group_parameters(op):
        value = arguments.get(parameter.name)
        if isinstance(value, str) or _is_group_object(value):
            found.append(NamedGroup(parameter.name, value, _group_of(value)))
    return found


def _is_group_object(value: Any) -> bool:
    """Whether ``value`` is a process group itself: a ProcessGroup, a script object
    (boxed), or Inductor's IR of one."""
    import torch.distributed as dist

    return (
        hasattr(value, "get_real_obj")
        or isinstance(value, torch.ScriptObject)
        or (dist.is_available() and isinstance(value, dist.ProcessGroup))
    )


def call_names_a_group(op: Any, arguments: Mapping[str, Any]) -> bool:
    """Whether a call of ``op`` with ``arguments`` names a process group this rank
    knows, or is a known collective."""
    return is_collective_op(op) or any(
        n.group is not None for n in named_groups(op, arguments)
    )


def node_arguments(node: torch.fx.Node, gm: torch.nn.Module) -> dict[str, Any]:
    """The arguments, by name, of the call ``node`` of ``gm`` (defaults included,
    attributes such as script objects read from ``gm``)."""
    values = {}
    schema = node.target._schema  # type: ignore[union-attr]
    for i, argument in enumerate(schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            continue
        if isinstance(value, torch.fx.Node) and value.op == "get_attr":
            value = getattr(gm, value.target)  # type: ignore[arg-type]
        values[argument.name] = value
    return values


def lowered_call_names_a_group(op: OpOverload) -> bool:
    """:func:`call_names_a_group` for the call of ``op`` Inductor is lowering (the
    graph's current node); where that node is no call of ``op``, whether the op may
    communicate at all."""
    from torch._inductor.virtualized import V

    node = getattr(V.graph, "current_node", None) if V.graph is not None else None
    if node is None or node.target is not op:
        return may_communicate(op)
    return call_names_a_group(op, node_arguments(node, V.graph.module))


def _is_collective_call(node: torch.fx.Node, gm: torch.nn.Module) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return (
        is_collective_op(target)
        or any(takes_group_by_type(a) for a in target._schema.arguments)
        or call_names_a_group(target, node_arguments(node, gm))
    )


def collective_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The calls in ``gm`` that communicate (see the module's rule)."""
    return [node for node in gm.graph.nodes if _is_collective_call(node, gm)]


def communicated_groups(gm: torch.fx.GraphModule) -> list[NamedGroup]:
    """The groups the collective calls of ``gm`` pass, each as its call names it."""
    return [
        named
        for node in collective_calls(gm)
        for named in named_groups(node.target, node_arguments(node, gm))
    ]


def _group_of(value: Any) -> ProcessGroup | None:
    """The ProcessGroup ``value`` (a group, a boxed or lowered one, or a name) is or
    names on this rank, else None."""
    import torch.distributed as dist

    if hasattr(value, "get_real_obj"):  # a lowered script object (Inductor IR)
        value = value.get_real_obj()
    if isinstance(value, dist.ProcessGroup):
        return value
    if isinstance(value, torch.ScriptObject):
        is_group = value._type() == _process_group_type()
        return dist.ProcessGroup.unbox(value) if is_group else None
    if isinstance(value, str) and dist.is_available() and dist.is_initialized():
        try:
            return torch._C._distributed_c10d._resolve_process_group(value)
        except RuntimeError:  # c10d knows no such group
            return None
    return None


def synchronised_group(
    op: OpOverload, arguments: Mapping[str, Any], communicated: Sequence[NamedGroup]
) -> ProcessGroup:
    """The group a call of ``op`` with ``arguments`` is tuned over, the one rule: the
    smallest known group containing the groups its arguments name; where they name
    none, the one containing the groups its choices' and its own implementation's
    collectives pass (``communicated``); else WORLD.

    Raises ValueError, naming the op, the argument and the value, where an argument or
    a collective names no group this rank knows."""
    import torch.distributed as dist

    named = named_groups(op, arguments)
    unknown = [n for n in [*named, *communicated] if n.group is None]
    if unknown:
        raise ValueError(
            f"{op_name(op)} communicates, but "
            + "; ".join(
                f"{'its argument' if n in named else 'a collective passes'} "
                f"{n.describe()}"
                for n in unknown
            )
            + " names no process group this rank knows: pass the name of a group "
            "made with torch.distributed.new_group (ProcessGroup.group_name); a string "
            f"that is no group must not be named {' or '.join(GROUP_ARGUMENTS)}"
        )
    groups = [n.group for n in named] or [c.group for c in communicated]
    if not groups:
        return dist.group.WORLD
    return covering_group(groups)  # type: ignore[arg-type]


def outside(group: ProcessGroup, communicated: Sequence[NamedGroup]) -> str:
    """Why ``communicated`` (a choice's groups) reach beyond ``group``, or "": timed in
    lockstep over ``group``, such a collective would wait for ranks outside it."""
    import torch.distributed as dist

    ranks = set(dist.get_process_group_ranks(group))
    for named in communicated:
        if named.group is None:
            continue
        theirs = dist.get_process_group_ranks(named.group)
        if not set(theirs) <= ranks:
            return (
                f"communicates over group {named.group.group_name} (ranks {theirs}), "
                f"beyond the op's group {group.group_name} (ranks {sorted(ranks)})"
            )
    return ""


def covering_group(groups: Sequence[ProcessGroup]) -> ProcessGroup:
    """The smallest known group (of ``groups`` and WORLD) that contains them all."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if not groups:
        return world
    unique = list({g.group_name: g for g in groups}.values())
    if len(unique) == 1:
        return unique[0]
    needed = set().union(*(dist.get_process_group_ranks(g) for g in unique))
    covering = min(
        (g for g in [*unique, world] if needed <= set(dist.get_process_group_ranks(g))),
        key=lambda g: g.size(),
    )
    log.info(
        "choices communicate over groups %s; synchronising autotuning over group %s "
        "(ranks %s), which contains them all",
        [g.group_name for g in unique],
        covering.group_name,
        dist.get_process_group_ranks(covering),
    )
    return covering
