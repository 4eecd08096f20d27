"""What collective autotuning remembers while Inductor lowers a graph, in one object.

:func:`graph_state` is the state of one graph (a GraphLowering): made at its first use
while the graph is lowered and dropped with the graph, as it is kept weakly by it. No
hook of ours runs where a graph's lowering starts and ends (upstream's compile_fx), and
the compiled graph reads the state after lowering (hooks.inlined_decisions).
:func:`function_memo` and :func:`frame_state` keep what outlives one graph on purpose,
weakly by its owner, for as long as it lives.

Every collective module may import this one, so it imports none of them: a field whose
type lives in a module that keeps its state here is typed Any, its comment naming it.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any, TYPE_CHECKING, TypeVar


if TYPE_CHECKING:
    import torch
    from torch._inductor.graph import GraphLowering


@dataclasses.dataclass
class CollectiveGraphState:
    """The collective autotuning state of one graph being lowered."""

    # Its sessions by group name (graph_sessions.GroupSession), joined at its first
    # collective-tuned site; None until then.
    sessions: dict[str, Any] | None = None
    # Sites prepared before tracing by op name (selection.CallSite), taken by
    # decide_site.
    prepared_sites: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Settings and code identities: constant while the graph is lowered, otherwise
    # recomputed for every range and layer.
    constants: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict)
    # traced_once's traces by (implementation, op): a choice is traced once per graph.
    traces: dict[tuple[Callable[..., Any], Any], dict[Any, Any]] = dataclasses.field(
        default_factory=dict
    )
    # benchmark_module's size-generic modules (None: none could be made), so ranges
    # do not each recompile a choice.
    benchmark_modules: dict[tuple[Any, ...], Any] = dataclasses.field(
        default_factory=dict
    )
    # Size dispatches traced once and copied for every site that dispatches alike.
    traced_dispatches: dict[tuple[Any, ...], torch.fx.GraphModule] = dataclasses.field(
        default_factory=dict
    )
    # How each dynamic call site, by autotuning name, runs its sizes
    # (records.SizePathRecord): the graph's cache entry keeps it.
    size_paths: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Range tops guarded so far per size expression, shared by all its ranges.
    partitions: dict[str, set[float]] = dataclasses.field(default_factory=dict)
    # _known's results by (size, tops) (range_graphs.GuardedRange and how found):
    # knowledge of a size only narrows while the graph is lowered.
    known_ranges: dict[tuple[str, tuple[float, ...]], tuple[Any, str]] = (
        dataclasses.field(default_factory=dict)
    )
    # The ranges the graph was guarded on (range_graphs.GuardedRange): its cache
    # entry is valid only where guards are checked.
    guarded_ranges: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class TraceState:
    """What tracing one guarded implementation showed: why it raised ("" if it did
    not), and the traces :func:`choices.traced_once` shares (None: not a collective
    op's)."""

    failure: str = ""
    traces: dict[Any, Any] | None = None


@dataclasses.dataclass
class FunctionMemo:
    """What tracing one function showed, kept as long as the function lives: a
    function defined anew is traced anew."""

    # A guarded or trace-sharing wrapper's trace (choices.py).
    trace: TraceState | None = None
    # A with_waits wrapper's (implementation, op) (waits.py).
    wrapped: tuple[Callable[..., Any], Any] | None = None
    # An implementation's waits at its latest trace (waits.Waits); None: untraced.
    waits: Any = None
    # An op body's own traces (waits.OwnImplementation) by call's arguments: the
    # groups a body communicates over are those its call names.
    own_implementations: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class FrameState:
    """The state of one frame's compile, shared by its forward and backward graphs."""

    # The ladder's top of each dynamic size, as the frame's first site saw it.
    ladder_uppers: dict[str, int] = dataclasses.field(default_factory=dict)


# By graph (a GraphLowering), for its life.
_graph_states = weakref.WeakKeyDictionary["GraphLowering", CollectiveGraphState]()
# By function (FunctionMemo) or by a frame's ShapeEnv (FrameState), for their lives.
_kept = weakref.WeakKeyDictionary[Any, FunctionMemo | FrameState]()


def graph_state(graph: GraphLowering | None = None) -> CollectiveGraphState:
    """The state of ``graph``, by default the graph being lowered."""
    if graph is None:
        from torch._inductor.virtualized import V

        graph = V.graph
    state = _graph_states.get(graph)
    if state is None:
        state = _graph_states[graph] = CollectiveGraphState()
    return state


def recorded_graph_state(graph: GraphLowering) -> CollectiveGraphState | None:
    """``graph``'s state if collective autotuning made one while lowering it: a graph
    without collective ops gets none."""
    return _graph_states.get(graph)


def function_memo(fn: Callable[..., Any]) -> FunctionMemo:
    """``fn``'s memo, made on first use; TypeError where ``fn`` cannot be weakly
    referenced."""
    return _kept_for(fn, FunctionMemo)


def recorded_memo(fn: Any) -> FunctionMemo | None:
    """``fn``'s memo if it has one; None also where it cannot be weakly referenced."""
    try:
        memo = _kept.get(fn)
    except TypeError:  # None, or a callable without weak references
        return None
    return memo if isinstance(memo, FunctionMemo) else None


def frame_state(shape_env: Any) -> FrameState:
    """The state of the frame compile whose ShapeEnv is ``shape_env``."""
    return _kept_for(shape_env, FrameState)


_Kept = TypeVar("_Kept", FunctionMemo, FrameState)


def _kept_for(owner: Any, kind: type[_Kept]) -> _Kept:
    kept = _kept.get(owner)
    if kept is None:
        kept = _kept[owner] = kind()
    assert isinstance(kept, kind)  # an owner is a function or a ShapeEnv, never both
    return kept
