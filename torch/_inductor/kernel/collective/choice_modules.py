"""A collective op's choices as the benchmark runs them: compiled once, with neighbours.

An inlined choice can absorb the pointwise work around it or reduce an owned input in
place, where the op's own call cannot: so it is timed between stand-ins (negations).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.kernel.collective.detection import (
    is_collective_op,
    named_groups,
    node_arguments,
    uses_symmetric_memory,
)
from torch._inductor.kernel.collective.waits import is_functional_collective, is_wait


@dataclasses.dataclass(frozen=True)
class Neighbours:
    """A site's neighbours: a pointwise ``producer`` of its first input or ``consumer``
    of its result, or an ``owned_input`` (another kernel's output, read by it alone)."""

    producer: bool = False
    consumer: bool = False
    owned_input: bool = False

    def __str__(self) -> str:
        return (
            "+".join(
                n
                for n, on in (
                    ("producer", self.producer),
                    ("owned-input", self.owned_input),
                    ("consumer", self.consumer),
                )
                if on
            )
            or "none"
        )

    @property
    def input_reduced_in_place(self) -> bool:
        """Whether an inlined all-reduce reduces the first input in place, uncopied."""
        return self.producer or self.owned_input

    @property
    def fused(self) -> Neighbours:
        """The neighbours compiled in: an owned input's producer runs before."""
        return dataclasses.replace(self, owned_input=False)

    def around(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        if not (self.input_reduced_in_place or self.consumer):
            return fn

        @functools.wraps(fn)
        def with_neighbours(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            x = torch.neg(x) if self.input_reduced_in_place else x
            out = fn(x, *args, **kwargs)
            return torch.neg(out) if self.consumer else out

        return with_neighbours


def neighbours_of_site(inputs: Sequence[Any]) -> Neighbours:
    """The :class:`Neighbours` of the site being lowered. A producer counts realized or
    not: the layout constraint's copy of it still fuses with an inlined choice."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    if not inputs:
        return Neighbours()
    first = inputs[0]
    storage = first.data if isinstance(first, ir.TensorBox) else None
    buffer = storage.data if isinstance(storage, ir.StorageBox) else None
    computed = buffer.data if isinstance(buffer, ir.ComputedBuffer) else buffer
    floating = first.get_dtype().is_floating_point
    producer = isinstance(computed, ir.Pointwise) and floating
    node = getattr(V.graph, "current_node", None)
    consumer = node is not None and any(
        torch.Tag.pointwise in getattr(user.target, "tags", ()) for user in node.users
    )
    args = node.args if node is not None else ()
    arg = next((a for a in args if isinstance(a, torch.fx.Node)), None)
    read_by = arg.users if arg is not None else ()
    owned_input = (
        not producer
        and floating
        and isinstance(buffer, ir.Buffer)
        and not isinstance(buffer, ir.InputBuffer)
        and list(read_by) == [node]
    )
    return Neighbours(producer, consumer, owned_input)


def implementation_of(choice: Any) -> Callable[..., Any]:
    """``choice``'s implementation, unguarded: a failure here is not the choice's."""
    return getattr(choice.decomposition, "__wrapped__", choice.decomposition)


@dataclasses.dataclass(frozen=True)
class EagerModule:
    """A traced choice run eagerly between stand-ins, called as a compiled module is."""

    run: Callable[..., torch.Tensor]
    sym_inputs: int

    def call(self, args: Sequence[Any]) -> list[torch.Tensor]:
        return [self.run(*args[self.sym_inputs :])]


@dataclasses.dataclass(frozen=True)
class AfterOwnedInput:
    """A compiled choice run after its owned input's stand-in (a kernel of its own)."""

    module: Any
    sym_inputs: int

    def call(self, args: Sequence[Any]) -> list[torch.Tensor]:
        args = list(args)
        args[self.sym_inputs] = torch.neg(args[self.sym_inputs])
        return self.module.call(args)


def eager_module(choice: Any, neighbours: Neighbours) -> EagerModule:
    """``choice``'s traced graph run eagerly between ``neighbours``' stand-ins: on CPUs
    (compiling costs more than it saves) and where :func:`costs_alike_uncompiled`."""
    gm = choice.gm
    if neighbours.input_reduced_in_place and _all_reduce_of_first_input(gm) is not None:
        gm = _reduced_in_place(gm)
    return EagerModule(neighbours.around(for_timing(gm)), len(choice.sym_input_values))


def for_timing(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` as the benchmark runs it: its collectives on the timing group of the
    groups they name (collective_timing_group), so that a choice that hangs leaves the
    user's communicators alone. Opaque calls (custom ops) and symmetric-memory ops
    keep their groups: their bodies, or their memory, belong to those groups."""
    if not any(_timing_names(node, gm) for node in gm.graph.nodes):
        return gm
    rewritten = _copied(gm)
    for node in rewritten.graph.nodes:
        for argument, name in _timing_names(node, rewritten).items():
            names = [a.name for a in node.target._schema.arguments]  # type: ignore[union-attr]
            index = names.index(argument)
            if index < len(node.args):
                node.update_arg(index, name)
            else:
                node.update_kwarg(argument, name)
    rewritten.recompile()
    return rewritten


def _timing_names(node: torch.fx.Node, gm: torch.fx.GraphModule) -> dict[str, str]:
    """By argument: the name a collective call ``node`` passes for its group while
    timed, where it names a group by a string."""
    from torch._inductor.runtime.collective_timing_group import timing_name

    if not _times_on_its_group(node.target):
        return {}
    return {
        named.argument: timing_name(named.value)
        for named in named_groups(node.target, node_arguments(node, gm))
        if isinstance(named.value, str) and named.group is not None
    }


def _times_on_its_group(op: Any) -> bool:
    """Whether a call of ``op`` runs on the timing group while timed."""
    return (
        isinstance(op, torch._ops.OpOverload)
        and is_collective_op(op)
        and not uses_symmetric_memory(op)
    )


def to_inline(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """``gm`` as the op being lowered inlines it: an all-reduce of an owned first input
    made in place, as the reinplace pass (blind to choices) does in the model."""
    from torch._inductor import config

    if not config.collective_autotune or _all_reduce_of_first_input(gm) is None:
        return gm
    if not neighbours_of_site(inputs).owned_input:
        return gm
    return _reduced_in_place(gm)


def only_calls_opaque_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor calls every op of traced ``gm`` as it is (nothing to fuse)."""
    calls = _calls(gm)
    return bool(calls) and all(map(_called_as_it_is, calls))


def costs_alike_uncompiled(gm: torch.fx.GraphModule, neighbours: Neighbours) -> bool:
    """Whether :func:`eager_module` of ``gm`` costs the device what compiling it with
    ``neighbours`` would: opaque calls, collectives of inputs Inductor won't copy."""
    from torch._inductor import config

    calls = _calls(gm)
    if config._collective.auto_select or not calls:
        return only_calls_opaque_ops(gm)
    if not all(
        _called_as_it_is(op) or is_functional_collective(op) or is_wait(op)
        for op in calls
    ):
        return False
    first = _first_input(gm)
    reduced = (
        _all_reduce_of_first_input(gm) if neighbours.input_reduced_in_place else None
    )
    for node in gm.graph.nodes:
        if not is_functional_collective(node.target):
            continue
        if node is reduced:
            continue
        sources = node.all_input_nodes
        if any(source.op != "placeholder" for source in sources):
            return False
        if _copies_its_inputs(node.target):
            return False
        if neighbours.input_reduced_in_place and first in sources:
            return False
    return True


def _is_functional_all_reduce(op: Any) -> bool:
    return op is torch.ops._c10d_functional.all_reduce.default


def _copies_its_inputs(op: Any) -> bool:
    """Whether the functional collective ``op`` copies its input before it
    communicates (its in-place twin does not)."""
    fc = torch.ops._c10d_functional
    return op in (
        fc.all_reduce.default,
        fc.all_reduce_coalesced.default,
        fc.broadcast.default,
    )


def _first_input(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    return next((n for n in gm.graph.nodes if n.op == "placeholder"), None)


def _all_reduce_of_first_input(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The functional all-reduce that alone uses ``gm``'s first input, or None."""
    first = _first_input(gm)
    users = list(first.users) if first is not None else []
    if len(users) == 1 and _is_functional_all_reduce(users[0].target):
        return users[0]
    return None


def _copied(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its graph copied node by node (a deep copy would copy the fake
    tensors a choice may hold as constants); node names are kept."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    return torch.fx.GraphModule(gm, graph)


def _reduced_in_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its first input's all-reduce made ``all_reduce_``."""
    rewritten = _copied(gm)
    node = _all_reduce_of_first_input(rewritten)
    assert node is not None
    node.target = torch.ops._c10d_functional.all_reduce_.default
    rewritten.recompile()
    return rewritten


def _calls(gm: torch.fx.GraphModule) -> list[Any]:
    import operator

    return [
        node.target
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is not operator.getitem
    ]


def _called_as_it_is(op: Any) -> bool:
    """Whether Inductor calls ``op`` as it is: no lowering of its own, or a fallback."""
    from torch._inductor.lowering import fallbacks, lowerings

    return isinstance(op, torch._ops.OpOverload) and (
        op not in lowerings or op in fallbacks
    )


class Stage(enum.Enum):
    """How far to compile a choice for the benchmark."""

    COMPILE = "compile"  # the module
    LOWER = "lower"  # the lowered graph
    START = "start"  # code generated now; a function that loads the module later

    def flags(self) -> dict[str, bool]:
        return {"lower_only": self is Stage.LOWER, "defer_load": self is Stage.START}


def module_for_benchmark(
    choice: Any, neighbours: Neighbours, stage: Stage = Stage.COMPILE
) -> Any:
    """``choice`` compiled at its inputs' sizes, with ``neighbours`` fused in."""
    if neighbours == Neighbours():
        timed = for_timing(choice.gm)
        if timed is choice.gm:
            return choice._compile_for_benchmarking(**stage.flags())
        twin = copy.copy(choice)
        twin.gm, twin._compiled_module = timed, None
        return twin._compile_for_benchmarking(**stage.flags())
    return compiled_module(
        choice, neighbours.around(implementation_of(choice)), False, stage
    )


def compiled_module(
    choice: Any,
    implementation: Callable[..., Any],
    symbolic: bool,
    stage: Stage = Stage.COMPILE,
) -> Any:
    """``implementation`` traced on ``choice``'s inputs and compiled as a benchmark
    choice is. With ``symbolic``, a new guard on the sizes raises."""
    from torch._inductor.ir import gm_original_output_strides

    gm, inputs = trace_on_symbolic_sizes(
        implementation, choice.decomposition_kwargs, choice.input_nodes, symbolic
    )
    gm_original_output_strides(gm)
    twin = copy.copy(choice)
    twin.gm, twin.example_inputs, twin._compiled_module = for_timing(gm), inputs, None
    # As torch 2.13 compiles choices: the lowering's size guards are the model's too.
    return twin._compile_for_benchmarking(**stage.flags())


def trace_on_symbolic_sizes(
    implementation: Callable[..., Any],
    kwargs: dict[str, Any],
    input_nodes: Sequence[Any],
    refuse_guards: bool = True,
) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``implementation`` traced on ``input_nodes``' symbolic sizes, and its inputs."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.ir import ir_node_to_tensor
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    shape_env = V.graph.sizevars.shape_env
    refusal = (
        shape_env.error_on_new_guards() if refuse_guards else contextlib.nullcontext()
    )
    with V.fake_mode, refusal:
        inputs = [ir_node_to_tensor(n) for n in input_nodes]
        gm = make_fx(
            functools.partial(implementation, **kwargs),
            decomposition_table=select_decomp_table(),
            tracing_mode="symbolic",
        )(*inputs)
    return gm, inputs
