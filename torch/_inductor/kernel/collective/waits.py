"""Functional collectives that a user's implementation never waited for.

A functional collective (``torch.ops._c10d_functional.all_reduce_`` and the like) only
issues the communication: its output, and for an in-place one its input, holds the
result once ``wait_tensor`` returned. Upstream's own tests, and code written after them,
return such an output without waiting, or read it at once
(``all_reduce_(buf, "avg") * world_size``). Compiled, the read races with the
communication and the result differs from rank to rank.

So an implementation of a collective op is traced with the waits its author left out
(:func:`with_waits`): right before the first op that reads a collective's output that
was not waited for, and at the implementation's output; nothing else changes, and an
implementation that waits where it should is traced exactly as written. The log says so
once per implementation. The op's own implementation runs as an opaque call of the op,
whose inside cannot be changed: where its body returns an unwaited collective's output,
the call is followed by a wait (:func:`trace_own_implementation`); where it reads one
inside, no wait from outside can help, and every rank raises, naming the read.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.kernel.collective.detection import op_name
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

log = logging.getLogger(__name__)

# Where a wait that the author left out goes, as the log names it.
AT_OUTPUT = "the op's output"


def _wait_op() -> torch._ops.OpOverload:
    return torch.ops._c10d_functional.wait_tensor.default


def is_functional_collective(func: Any) -> bool:
    """Whether ``func`` issues a functional collective (whose result needs a wait)."""
    return (
        isinstance(func, torch._ops.OpOverload)
        and func.namespace == "_c10d_functional"
        and not is_wait(func)
    )


def is_wait(func: Any) -> bool:
    """Whether ``func`` is the functional collectives' ``wait_tensor``."""
    return func is _wait_op()


class WaitBeforeRead(TorchDispatchMode):
    """Adds ``wait_tensor`` before the first op that reads the output of a functional
    collective that was not waited for; ``added`` says where it did.

    Active inside an implementation while it is traced (or run), so the waits land in
    its graph where the author's would have: ops that do not read such an output, and
    collectives that are waited for before being read, pass through unchanged."""

    def __init__(self) -> None:
        super().__init__()
        # The tensors a collective writes and nobody waited for yet, by id, with the
        # collective's name (the tensors are kept alive with their entries).
        self.pending: dict[int, tuple[torch.Tensor, str]] = {}
        self.added: list[str] = []
        # The process groups (names) that the collectives seen run on.
        self.groups: list[str] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is _wait_op():
            tree_map_only(torch.Tensor, lambda t: self.pending.pop(id(t), None), args)
            return func(*args, **kwargs)
        if self.pending:
            args, kwargs = tree_map_only(
                torch.Tensor, lambda t: self.wait(t, func.name()), (args, kwargs)
            )
        out = func(*args, **kwargs)
        if is_functional_collective(func):
            self.groups += [
                value
                for argument, value in zip(func._schema.arguments, args)
                if argument.name == "group_name"
            ]
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

    def wait(self, tensor: torch.Tensor, reader: str) -> torch.Tensor:
        """``tensor`` waited for, where a collective's unwaited output is read by
        ``reader``; else ``tensor``."""
        entry = self.pending.pop(id(tensor), None)
        if entry is None:
            return tensor
        self.added.append(
            f"returns the output of {entry[1]} without wait_tensor"
            if reader == AT_OUTPUT
            else f"reads the output of {entry[1]} before wait_tensor (in {reader})"
        )
        return _wait_op()(tensor)


class Waits(enum.Enum):
    """What an implementation needs of the graph it is traced into."""

    # It waits for its collectives (or has none, or could not be traced: run as it is).
    NONE = "none"
    # It returns a collective's output unwaited: a wait follows it.
    OUTPUT = "output"
    # It reads a collective's output before waiting: a wait is needed inside it.
    READS = "reads"

    @staticmethod
    def of(added: Sequence[str]) -> Waits:
        if any(a.startswith("reads") for a in added):
            return Waits.READS
        return Waits.OUTPUT if added else Waits.NONE


# What tracing each implementation showed, for as long as it lives: a function
# defined anew is traced anew.
_found: weakref.WeakKeyDictionary[Callable[..., Any], Waits] = (
    weakref.WeakKeyDictionary()
)


def with_waits(
    implementation: Callable[..., Any], op: torch._ops.OpOverload
) -> Callable[..., Any]:
    """``implementation`` of ``op``, waiting for its functional collectives where its
    author did not (see :class:`WaitBeforeRead`), at the first read and at its output.

    Dynamo cannot trace a dispatch mode, and traces the branches of upstream's size
    dispatch (``torch.cond``, an op that does not communicate): there the
    implementation runs as written; a collective op's dispatch calls
    :func:`dispatchable` instead."""

    @functools.wraps(implementation)
    def waited(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return implementation(*args, **kwargs)
        mode = WaitBeforeRead()
        with mode:
            out = implementation(*args, **kwargs)
            out = tree_map_only(torch.Tensor, lambda t: mode.wait(t, AT_OUTPUT), out)
        _found[implementation] = Waits.of(mode.added)
        if mode.added:
            _say_waited(
                op_name(op), getattr(implementation, "__name__", ""), mode.added
            )
        return out

    _waited[waited] = (implementation, op)
    return waited


# Each wrapper with_waits made, with what it wraps.
_waited: weakref.WeakKeyDictionary[
    Callable[..., Any], tuple[Callable[..., Any], Any]
] = weakref.WeakKeyDictionary()


def _wrapped_by_with_waits(fn: Any) -> tuple[Callable[..., Any], Any] | None:
    """The implementation and op of the with_waits wrapper that ``fn`` is or wraps
    (functools.wraps), or None."""
    while fn is not None:
        try:
            found = _waited.get(fn)
        except TypeError:  # a callable without weak references
            return None
        if found is not None:
            return found
        fn = getattr(fn, "__wrapped__", None)
    return None


def dispatchable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (made by :func:`with_waits`, or a wrapper of such) for a size dispatch,
    whose branches are traced once for every call site: the implementation followed by
    waits for its outputs where Inductor's own trace of it found one unwaited. One
    found reading an unwaited output inside stops every rank (they all traced it
    alike). Resolved before the dispatch is traced, so its branches are plain calls."""
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError

    wrapped = _wrapped_by_with_waits(fn)
    if wrapped is None:
        return fn
    implementation, op = wrapped
    found = _found.get(implementation, Waits.NONE)
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


def _say_waited(op: str, implementation: str, added: Sequence[str]) -> None:
    torch._logging.warning_once(
        log,
        "collective autotuning: %s's implementation %s %s; Inductor waits for the "
        "collective there, so that every rank gets the same result",
        op,
        implementation,
        "; ".join(dict.fromkeys(added)),
    )


@dataclasses.dataclass(frozen=True)
class OwnImplementation:
    """What tracing the op's own implementation showed."""

    waits: Waits = Waits.NONE
    # The process groups (names) of the functional collectives it calls.
    groups: tuple[str, ...] = ()


# What tracing each op's own implementation (its Python body) showed, for as long as
# the body lives: an op defined anew is traced anew.
_own: weakref.WeakKeyDictionary[Callable[..., Any], OwnImplementation] = (
    weakref.WeakKeyDictionary()
)


def trace_own_implementation(
    op: torch._ops.OpOverload,
    body: Callable[..., Any],
    inputs: Sequence[Any],
    kwargs: dict[str, Any],
) -> OwnImplementation:
    """What ``body``, the op's own implementation (the Python body of ``op``), does with
    functional collectives when called on ``inputs`` (IR nodes of the call being
    lowered) with ``kwargs``: on which groups it calls them, and whether it returns
    one's output unwaited; remembered for :func:`recorded_own_waits`. Raises
    CollectiveAutotuneError where it reads one inside: the same on every rank, which all
    trace the same body. A body that cannot be traced runs as it is."""
    from torch._inductor.ir import ir_node_to_tensor
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    if body in _own:
        return _own[body]
    mode = WaitBeforeRead()

    def traced(*tensors: torch.Tensor) -> Any:
        with mode:
            out = body(*tensors, **kwargs)
            return tree_map_only(torch.Tensor, lambda t: mode.wait(t, AT_OUTPUT), out)

    try:
        with V.fake_mode:
            make_fx(traced, tracing_mode="symbolic")(
                *[ir_node_to_tensor(n) for n in inputs]
            )
    except Exception:  # a body make_fx cannot trace runs as it is
        log.debug(
            "the own implementation of %s could not be traced",
            op_name(op),
            exc_info=True,
        )
        _own[body] = OwnImplementation()
        return _own[body]
    if Waits.of(mode.added) is Waits.READS:
        inside = [a for a in mode.added if a.startswith("reads")]
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
    _own[body] = OwnImplementation(
        Waits.of(mode.added), tuple(dict.fromkeys(mode.groups))
    )
    return _own[body]


def recorded_own_waits(body: Any) -> Waits:
    """What :func:`trace_own_implementation` found ``body`` needs (NONE where it did not
    trace it)."""
    own = _own.get(body) if body is not None else None
    return own.waits if own is not None else Waits.NONE


def wait_for_output(node: Any) -> Any:
    """``node`` (the lowered call of an op's own implementation) followed by a wait."""
    from torch._inductor.lowering import lowerings

    return lowerings[_wait_op()](node)


def waited_call(call: Callable[..., Any], waits: Waits) -> Callable[..., Any]:
    """``call`` followed by a wait for its outputs where ``waits`` says it leaves them
    unwaited."""
    if waits is not Waits.OUTPUT:
        return call

    @functools.wraps(call)
    def waited(*args: Any, **kwargs: Any) -> Any:
        return tree_map_only(torch.Tensor, _wait_op(), call(*args, **kwargs))

    return waited
