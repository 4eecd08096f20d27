"""A collective op's choices as the benchmark runs them: with the neighbours Inductor
fuses them with, compiled once.

Inside a model a choice does not run alone. An inlined functional all-reduce copies its
input into the buffer it reduces in place, and Inductor fuses a pointwise producer
(``all_reduce(relu(x @ w))``) into that copy; an opaque custom op cannot take the
producer's work, which then costs a pass over the data of its own. Timed on a graph
input, both pay one copy and tie (356 vs 357 µs at 64 MiB on 4 H200s); inside the model
the inlined one was 5% faster per step. Likewise a pointwise consumer may fuse into a
choice's own trailing pointwise work.

So a call site whose first input is computed by a pointwise op, or whose result feeds
one, is timed with a stand-in of each: every choice runs as
``consumer(choice(producer(x), ...))``, compiled together where the choice is a
subgraph (Inductor fuses them as it will in the model), eagerly around the op's own
implementation, and in graph mode around a subgraph that only calls opaque ops (as
the model runs an opaque op). The stand-in is a negation, which
costs what a pointwise neighbour costs and keeps a linear collective's result (the
correctness screen compares the choices' outputs as they are). What a site is fused
with is part of its key. The ranges of a dynamic op (kernel/collective/dispatch.py) are
timed with their call site's neighbours too: where one implementation wins every range
there is no dispatch, and it runs fused as timed. (Where winners differ, the size
dispatch is a fusion barrier: an inlined winner there pays the pass it was timed
without.)

:func:`module_for_benchmark` compiles a choice with its neighbours at its inputs' sizes;
:func:`compiled_module` compiles a choice's implementation, with its neighbours or
traced on symbolic sizes for every range of a dynamic op (collective/dispatch.py).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Neighbours:
    """The pointwise work a call site's choice is fused with in the model."""

    producer: bool = False
    consumer: bool = False

    def __str__(self) -> str:
        return (
            "+".join(
                n
                for n, on in (("producer", self.producer), ("consumer", self.consumer))
                if on
            )
            or "none"
        )

    def around(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``fn`` with the stand-ins of these neighbours around it."""
        if not (self.producer or self.consumer):
            return fn

        @functools.wraps(fn)
        def with_neighbours(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            out = fn(torch.neg(x) if self.producer else x, *args, **kwargs)
            return torch.neg(out) if self.consumer else out

        return with_neighbours


def neighbours_of_site(inputs: Sequence[Any]) -> Neighbours:
    """What the call site being lowered fuses with: a pointwise kernel computing its
    first input, a pointwise user of its result.

    The producer is found as a pointwise computation, realized or not: the custom op's
    layout constraint realizes it as a copy before the lowering runs, and Inductor
    still fuses that copy with an inlined choice's first pointwise step."""
    from torch._inductor import ir
    from torch._inductor.virtualized import V

    if not inputs:
        return Neighbours()
    first = inputs[0]
    storage = first.data if isinstance(first, ir.TensorBox) else None
    computed = storage.data if isinstance(storage, ir.StorageBox) else None
    if isinstance(computed, ir.ComputedBuffer):
        computed = computed.data
    producer = (
        isinstance(computed, ir.Pointwise) and first.get_dtype().is_floating_point
    )
    node = getattr(V.graph, "current_node", None)
    consumer = node is not None and any(
        torch.Tag.pointwise in getattr(user.target, "tags", ()) for user in node.users
    )
    return Neighbours(producer, consumer)


def implementation_of(choice: Any) -> Callable[..., Any]:
    """The user's implementation of a subgraph ``choice``, without the guard
    prepare_choices put around it (a failure here falls back; it is not the
    choice's)."""
    return getattr(choice.decomposition, "__wrapped__", choice.decomposition)


@dataclasses.dataclass(frozen=True)
class EagerModule:
    """A choice's traced graph run eagerly, its neighbours' stand-ins around it, called
    as a compiled benchmark module is: ``call([*sym_inputs, *tensors])`` returns its
    outputs."""

    run: Callable[..., torch.Tensor]
    sym_inputs: int

    def call(self, args: Sequence[Any]) -> list[torch.Tensor]:
        return [self.run(*args[self.sym_inputs :])]


def eager_module(choice: Any, neighbours: Neighbours) -> EagerModule:
    """A subgraph ``choice`` for the benchmark, its traced graph run eagerly with
    ``neighbours``' stand-ins around it: on a CPU, and in graph mode wherever the graph
    :func:`only_calls_opaque_ops` (collective/timing.py says why not in the default
    mode).

    A gloo collective takes tens of microseconds to milliseconds, and what Inductor's
    C++ kernels would save of the pointwise work around it is far less; compiling each
    choice with them took 1.5-3.7 s on a 2-core machine, several times the model's own
    compile. So on CPUs the choices are only lowered (a choice that cannot be compiled
    is dropped now, not found when the winner is inlined) and timed as traced: no C++
    is built for them. An opaque op (a symmetric-memory kernel that owns its buffer,
    say) is called as it is in the model too, where nothing fuses with it: its
    neighbours are kernels of their own there as here, and compiling it bought nothing
    but the compile (serving_step's first tuned compile in graph mode, two such choices
    of four, on one H200 with cold caches: 1.74-1.86 s against 1.89-1.97 s)."""
    return EagerModule(neighbours.around(choice.gm), len(choice.sym_input_values))


def only_calls_opaque_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor would call every op of traced graph ``gm`` as it is: custom ops
    it has no lowering of its own for (it makes them fallbacks when it first lowers
    them), or ops it falls back on. Nothing of such a graph is generated as a kernel,
    and nothing fuses with it."""
    import operator

    from torch._inductor.lowering import fallbacks, lowerings

    calls = [
        node.target
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is not operator.getitem
    ]
    return bool(calls) and all(
        isinstance(op, torch._ops.OpOverload)
        and (op not in lowerings or op in fallbacks)
        for op in calls
    )


@dataclasses.dataclass(frozen=True)
class Stage:
    """How far to compile a choice for the benchmark: all the way (the module), only
    lowering it (``lower_only``: the lowered graph), or generating its code now and
    loading it later (``defer_load``: a function that loads the module)."""

    lower_only: bool = False
    defer_load: bool = False


COMPILE = Stage()
LOWER = Stage(lower_only=True)
START = Stage(defer_load=True)


def module_for_benchmark(
    choice: Any, neighbours: Neighbours, stage: Stage = COMPILE
) -> Any:
    """A subgraph ``choice`` compiled for the benchmark at its inputs' sizes, with
    ``neighbours`` fused in (without any, as Inductor compiles its choices: no new
    trace), as far as ``stage`` says."""
    if neighbours == Neighbours():
        return choice._compile_for_benchmarking(**dataclasses.asdict(stage))
    return compiled_module(
        choice, neighbours.around(implementation_of(choice)), False, stage
    )


def compiled_module(
    choice: Any,
    implementation: Callable[..., Any],
    symbolic: bool,
    stage: Stage = COMPILE,
) -> Any:
    """``implementation`` (a subgraph choice's, with whatever is around it) traced on
    the choice's inputs and compiled as Inductor compiles its benchmark choices, as far
    as ``stage`` says. With ``symbolic``, any guard the trace would add on the inputs'
    sizes raises instead (the module must be right at every size)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.ir import gm_original_output_strides, ir_node_to_tensor
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    shape_env = V.graph.sizevars.shape_env
    refusal = shape_env.error_on_new_guards() if symbolic else contextlib.nullcontext()
    with V.fake_mode, refusal:
        inputs = [ir_node_to_tensor(n) for n in choice.input_nodes]
        gm = make_fx(
            functools.partial(implementation, **choice.decomposition_kwargs),
            decomposition_table=select_decomp_table(),
            tracing_mode="symbolic",
        )(*inputs)
    gm_original_output_strides(gm)
    twin = copy.copy(choice)
    twin.gm, twin.example_inputs, twin._compiled_module = gm, inputs, None
    # Compiled as torch 2.13 compiles its choices: the lowering's guards on the sizes'
    # range (32-bit indexing, say) are the model's too.
    return twin._compile_for_benchmarking(**dataclasses.asdict(stage))
