"""Functional collectives that a user's implementation never waited for.

Read before ``wait_tensor``, a collective's output races with the communication and
differs between ranks. :func:`with_waits` adds the waits an implementation's author
left out; the op's own implementation (an opaque call) gets a wait after it, and raises
on every rank where it reads an unwaited output inside.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.kernel.collective.detection import (
    named_groups,
    NamedGroup,
    op_name,
)
from torch._inductor.kernel.collective.graph_state import function_memo, recorded_memo
from torch._inductor.kernel.collective.in_place import AsFunctional
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

log = logging.getLogger(__name__)


def _wait_op() -> torch._ops.OpOverload:
    return torch.ops._c10d_functional.wait_tensor.default


def is_functional_collective(func: Any) -> bool:
    """Whether ``func`` issues a functional collective (whose result needs a wait)."""
    return (
        isinstance(func, torch._ops.OpOverload)
        and func.namespace == "_c10d_functional"
        and not is_wait(func)
    )


@functools.cache
def _wait_ops() -> tuple[torch._ops.OpOverload, ...]:
    """The waits of functional collectives: wait_tensor, and from torch 2.15 on
    wait_tensors, which waits for a list (traced after a coalesced collective)."""
    ops = torch.ops._c10d_functional
    return (_wait_op(),) + (
        (ops.wait_tensors.default,) if hasattr(ops, "wait_tensors") else ()
    )


def is_wait(func: Any) -> bool:
    return any(func is wait for wait in _wait_ops())


@dataclasses.dataclass(frozen=True)
class AddedWait:
    """A wait :class:`WaitBeforeRead` added: after ``collective``, before ``reader``
    (an op that reads its output), or at the implementation's output (None)."""

    collective: str
    reader: str | None = None

    def describe(self) -> str:
        if self.reader is None:
            return f"returns the output of {self.collective} without wait_tensor"
        return (
            f"reads the output of {self.collective} before wait_tensor "
            f"(in {self.reader})"
        )


class WaitBeforeRead(TorchDispatchMode):
    """Adds ``wait_tensor`` before the first op that reads an unwaited functional
    collective's output; ``added`` says where. Everything else passes through."""

    def __init__(self) -> None:
        super().__init__()
        # Unwaited outputs by id, kept alive with their collective's name.
        self.pending: dict[int, tuple[torch.Tensor, str]] = {}
        self.added: list[AddedWait] = []
        # The process groups the collectives seen pass, as they name them.
        self.groups: list[NamedGroup] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if is_wait(func):
            tree_map_only(torch.Tensor, lambda t: self.pending.pop(id(t), None), args)
            return func(*args, **kwargs)
        if self.pending:
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: self.wait(t, func.name()), (args, kwargs)
            )
        out = func(*args, **kwargs)
        if is_functional_collective(func):
            names = [argument.name for argument in func._schema.arguments]
            self.groups += named_groups(func, {**dict(zip(names, args)), **kwargs})
            written = [out] + [
                value
                for argument, value in zip(func._schema.arguments, args)
                if argument.alias_info is not None and argument.alias_info.is_write
            ]
            for tensor in written:
                tree_map_only(
                    torch.Tensor,
                    lambda t: self.pending.__setitem__(id(t), (t, func.name())),
                    tensor,
                )
        return out

    def wait(self, tensor: torch.Tensor, reader: str | None = None) -> torch.Tensor:
        """``tensor``, waited for first where it is an unwaited collective output, before
        op ``reader`` reads it (None: at the implementation's output)."""
        entry = self.pending.pop(id(tensor), None)
        if entry is None:
            return tensor
        self.added.append(AddedWait(entry[1], reader))
        return _wait_op()(tensor)


class Waits(enum.Enum):
    """What an implementation needs of the graph it is traced into."""

    # Nothing: it waits for its collectives, has none, or could not be traced.
    NONE = "none"
    # A wait after it: it returns a collective's output unwaited.
    OUTPUT = "output"
    # A wait inside it: it reads a collective's output before waiting.
    READS = "reads"

    @staticmethod
    def of(added: Sequence[AddedWait]) -> Waits:
        if any(a.reader is not None for a in added):
            return Waits.READS
        return Waits.OUTPUT if added else Waits.NONE


def with_waits(
    implementation: Callable[..., Any], op: torch._ops.OpOverload
) -> Callable[..., Any]:
    """``implementation`` of ``op`` under :class:`WaitBeforeRead`. Under Dynamo (a size
    dispatch's branches) it runs as written: a dispatch calls :func:`dispatchable`."""

    @functools.wraps(implementation)
    def waited(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return implementation(*args, **kwargs)
        mode = WaitBeforeRead()
        with mode, AsFunctional():
            out = implementation(*args, **kwargs)
            out = tree_map_only(torch.Tensor, mode.wait, out)
        function_memo(implementation).waits = Waits.of(mode.added)
        if mode.added:
            _say_waited(
                op_name(op), getattr(implementation, "__name__", ""), mode.added
            )
        return out

    function_memo(waited).wrapped = (implementation, op)
    return waited


def _wrapped_by_with_waits(fn: Any) -> tuple[Callable[..., Any], Any] | None:
    """(implementation, op) of the with_waits wrapper ``fn`` is or wraps, or None."""
    while fn is not None:
        memo = recorded_memo(fn)
        if memo is not None and memo.wrapped is not None:
            return memo.wrapped
        fn = getattr(fn, "__wrapped__", None)
    return None


def unwaited(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The user's implementation that ``fn``'s with_waits wrapper wraps, else ``fn``:
    the wrapper is made anew at every range, the implementation is not."""
    wrapped = _wrapped_by_with_waits(fn)
    return fn if wrapped is None else wrapped[0]


def dispatchable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a size dispatch's plain call, with the output waits its trace found.
    Raises CollectiveAutotuneError, on every rank alike, where it reads one inside."""
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError

    wrapped = _wrapped_by_with_waits(fn)
    if wrapped is None:
        return fn
    implementation, op = wrapped
    recorded = function_memo(implementation).waits
    found = Waits.NONE if recorded is None else recorded
    if found is Waits.READS:
        raise CollectiveAutotuneError(
            f"{op_name(op)}: its implementation "
            f"{getattr(implementation, '__name__', '')} reads a functional "
            "collective's output before wait_tensor, and a size dispatch (dynamic "
            "sizes) traces it where Inductor cannot add the wait: call "
            "torch.ops._c10d_functional.wait_tensor on the collective's output before "
            "reading it"
        )
    return waited_call(implementation, found)


def _say_waited(op: str, implementation: str, added: Sequence[AddedWait]) -> None:
    torch._logging.warning_once(
        log,
        "collective autotuning: %s's implementation %s %s; Inductor waits for the "
        "collective there, so that every rank gets the same result",
        op,
        implementation,
        "; ".join(dict.fromkeys(a.describe() for a in added)),
    )


@dataclasses.dataclass(frozen=True)
class OwnImplementation:
    """What tracing the op's own implementation showed: its waits, and the groups its
    collectives pass."""

    waits: Waits = Waits.NONE
    groups: tuple[NamedGroup, ...] = ()


def trace_own_implementation(
    op: torch._ops.OpOverload,
    body: Callable[..., Any],
    inputs: Sequence[Any],
    kwargs: dict[str, Any],
) -> OwnImplementation:
    """What ``op``'s Python ``body`` does with functional collectives on IR ``inputs``
    (a body that cannot be traced runs as it is). Raises CollectiveAutotuneError, on
    every rank alike, where it reads an unwaited output inside."""
    from torch._inductor.ir import ir_node_to_tensor
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    traces: dict[str, OwnImplementation] = function_memo(body).own_implementations
    call = repr(sorted(kwargs.items()))
    if call in traces:
        return traces[call]
    mode = WaitBeforeRead()

    def traced(*tensors: torch.Tensor) -> Any:
        with mode, AsFunctional():
            out = body(*tensors, **kwargs)
            return tree_map_only(torch.Tensor, mode.wait, out)

    try:
        with V.fake_mode:
            make_fx(traced, tracing_mode="symbolic")(
                *[ir_node_to_tensor(n) for n in inputs]
            )
    except Exception:
        log.debug(
            "the own implementation of %s could not be traced",
            op_name(op),
            exc_info=True,
        )
        traces[call] = OwnImplementation()
        return traces[call]
    if Waits.of(mode.added) is Waits.READS:
        inside = [a.describe() for a in mode.added if a.reader is not None]
        raise CollectiveAutotuneError(
            f"{op_name(op)}: its own implementation "
            f"{'; '.join(dict.fromkeys(inside))}, so its result would differ between "
            "ranks. It runs as an opaque call, inside "
            "which Inductor cannot add the wait: call "
            "torch.ops._c10d_functional.wait_tensor on the collective's output before "
            "reading it"
        )
    if mode.added:
        _say_waited(op_name(op), "(its own)", mode.added)
    traces[call] = OwnImplementation(
        Waits.of(mode.added), tuple(dict.fromkeys(mode.groups))
    )
    return traces[call]


def recorded_own_waits(body: Any) -> Waits:
    """What :func:`trace_own_implementation` found ``body`` needs at its latest call
    (NONE if untraced): its code decides, not the call's arguments."""
    memo = recorded_memo(body)
    traces = memo.own_implementations if memo is not None else None
    return list(traces.values())[-1].waits if traces else Waits.NONE


def wait_for_output(node: Any) -> Any:
    """``node`` (the lowered call of an op's own implementation) followed by a wait."""
    from torch._inductor.lowering import lowerings

    return lowerings[_wait_op()](node)


def waited_call(call: Callable[..., Any], waits: Waits) -> Callable[..., Any]:
    """``call`` followed by a wait for its outputs where ``waits`` is OUTPUT."""
    if waits is not Waits.OUTPUT:
        return call

    @functools.wraps(call)
    def waited(*args: Any, **kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, _wait_op(), call(*args, **kwargs))

    return waited
