"""torch.distributed's in-place collectives in a choice, traced as functional ones.

Written as the c10d docs teach (``y = x.clone(); dist.all_reduce(y, group=g)``), a
collective traces to ``c10d::allreduce_``, which takes its group as a script object
that Inductor cannot compile. While a choice or the op's own implementation is traced
(:class:`AsFunctional`), such calls are remapped as Dynamo remaps them under
torch.compile (torch's ``traceable_collective_remaps``): the functional collective,
waited for and copied into the tensor. A call torch cannot remap (``dist.broadcast``,
point-to-point, ``async_op=True``) stays as it is, and the choice is dropped on every
rank with :func:`untraceable_collective`'s reason.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor.kernel.collective.detection import takes_group_by_type
from torch.overrides import TorchFunctionMode


def _remaps() -> dict[Callable[..., Any], Callable[..., Any]]:
    """torch's remaps of in-place c10d collectives to functional ones (none without
    distributed support)."""
    import torch.distributed as dist

    if not dist.is_available():
        return {}
    from torch.distributed import _functional_collectives as funcol

    return funcol.traceable_collective_remaps


def _reduce_op_names() -> dict[Any, str]:
    from torch.distributed import _functional_collectives as funcol

    return funcol.REDUCE_OP_TO_STR


class AsFunctional(TorchFunctionMode):
    """Calls of torch.distributed's in-place collectives run as their functional
    remaps; everything else passes through."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        remap = _remaps().get(func)
        if remap is None:
            return func(*args, **kwargs)
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
        op = bound.get("op")
        names = _reduce_op_names()
        if bound.get("async_op") or (op is not None and op not in names):
            return func(*args, **kwargs)  # not remappable: the choice is dropped
        if op is not None:
            bound["op"] = names[op]
        # As the in-place call does when not asynchronous.
        remap(**bound)
        return None


def untraceable_collective(gm: torch.fx.GraphModule | None) -> str:
    """Why ``gm`` calls a collective Inductor cannot compile (one that takes a
    ProcessGroup object, as torch.distributed's in-place calls trace to), or ""."""
    if gm is None:
        return ""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if any(takes_group_by_type(a) for a in target._schema.arguments):
            return (
                f"calls {target.name()}, which takes a ProcessGroup object (an "
                "in-place torch.distributed collective torch cannot trace as a "
                "functional one): Inductor cannot compile it; write it with "
                "torch.distributed._functional_collectives or "
                "torch.ops._c10d_functional, and wait_tensor before reading"
            )
    return ""
