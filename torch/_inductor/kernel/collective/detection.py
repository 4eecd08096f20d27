"""Which ops communicate, and over which process group.

An op is collective when it is a known collective (by exact name), takes a process-group
argument (:data:`GROUP_ARGUMENTS`), or its choices' traced graphs call a collective."""

from __future__ import annotations

import logging
from typing import Any, TYPE_CHECKING

import torch
from torch._inductor.runtime.collective_benchmarking import is_collective_op

if TYPE_CHECKING:
    from torch._ops import OpOverload
    from torch.distributed import ProcessGroup


log = logging.getLogger(__name__)

# Argument names through which an op or a collective names its process group.
GROUP_ARGUMENTS = ("group_name", "group", "process_group", "pg")


def op_name(op: OpOverload) -> str:
    """An op's qualified name ("ns::name")."""
    return op.name() if hasattr(op, "name") and callable(op.name) else str(op)


def names_a_collective(op: OpOverload) -> bool:
    """Whether ``op`` is a known collective or takes a process-group argument."""
    schema = getattr(op, "_schema", None)
    return is_collective_op(op) or (
        schema is not None and any(a.name in GROUP_ARGUMENTS for a in schema.arguments)
    )


def collective_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Calls in ``gm`` of known collectives and of non-builtin ops that take a group
    (builtins take none: ``aten::native_group_norm``'s ``group`` is a count)."""
    return [
        node
        for node in gm.graph.nodes
        if node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and (
            is_collective_op(node.target)
            or (
                not torch._library.utils.is_builtin(node.target)
                and names_a_collective(node.target)
            )
        )
    ]


def group_arguments(node: torch.fx.Node, gm: torch.fx.GraphModule) -> list[Any]:
    """The process groups (or their names) that the collective call ``node`` passes."""
    found = []
    args, kwargs = node.args, node.kwargs
    schema = node.target._schema  # type: ignore[union-attr]
    for i, argument in enumerate(schema.arguments):
        if argument.name not in GROUP_ARGUMENTS:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.fx.Node) and value.op == "get_attr":
            value = getattr(gm, value.target)  # type: ignore[arg-type]
        if value is not None:
            found.append(value)
    return found


def resolve_group(group: Any, op: OpOverload) -> ProcessGroup:
    """The ProcessGroup that ``group`` (a group, boxed group or name) names.

    Raises ValueError or TypeError, naming ``op``, where this rank cannot tell one."""
    import torch.distributed as dist

    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    if isinstance(group, str):
        try:
            return torch._C._distributed_c10d._resolve_process_group(group)
        except RuntimeError as e:
            raise ValueError(
                f"{op_name(op)} names process group {group!r}, which this rank does "
                "not know; pass the group name of a group created with "
                "torch.distributed.new_group (ProcessGroup.group_name)"
            ) from e
    raise TypeError(
        f"{op_name(op)}: cannot tell a process group from {group!r} "
        f"({type(group).__name__}); expected a ProcessGroup or a group name"
    )


def covering_group(groups: list[ProcessGroup]) -> ProcessGroup:
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
