"""A collective op's choices as the benchmark runs them: with the neighbours Inductor
fuses them with, compiled once.

Inside a model a choice does not run alone. An inlined functional all-reduce copies its
input into the buffer it reduces in place, and Inductor fuses a pointwise producer
(``all_reduce(relu(x @ w))``) into that copy; an opaque custom op cannot take the
producer's work, which then costs a pass over the data of its own. Timed on a graph
input, both pay one copy and tie (356 vs 357 µs at 64 MiB on 4 H200s); inside the model
the inlined one was 5% faster per step. Likewise a pointwise consumer may fuse into a
choice's own trailing pointwise work.

A graph input is copied by an inlined all-reduce too, where the output of a kernel that
only the op reads is reduced in place (comm_lowering's copy left out): in a model of
layers ``x + all_reduce(x @ w)`` on 2 H200s the inlined NCCL all-reduce stepped 3.8%
faster than the op's own (which copies) at 16384 tokens, where timed on a graph input
both copied and the op's own was kept.

So a call site whose first input is computed by a pointwise op (or by another kernel
for it alone), or whose result feeds one, is timed with a stand-in of each: every
choice runs as
``consumer(choice(producer(x), ...))``, compiled together where the choice is a
subgraph (Inductor fuses them as it will in the model), eagerly around the op's own
implementation, and around a subgraph whose compile would buy nothing (opaque ops and
functional collectives; see costs_alike_uncompiled, and timing.timed_as_traced for
when). The stand-in of an owned input's producer is never compiled in: nothing fuses
with a matmul (:class:`AfterOwnedInput`). The stand-in is a negation, which
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
import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.kernel.collective.waits import is_functional_collective, is_wait


@dataclasses.dataclass(frozen=True)
class Neighbours:
    """The work a call site's choice runs between in the model: a pointwise kernel
    computing its first input (``producer``, which Inductor fuses with an inlined
    choice), a pointwise user of its result (``consumer``), or another kernel computing
    the first input for this op alone (``owned_input``: a matmul, say), which nothing
    fuses with but whose output an inlined all-reduce reduces in place, with no copy."""

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
        """Whether the model computes the first input into a buffer of its own that
        an inlined all-reduce of it reduces in place (the producer fused into the
        all-reduce's input copy, or the copy of an owned input left out)."""
        return self.producer or self.owned_input

    @property
    def fused(self) -> Neighbours:
        """The neighbours a compiled choice is compiled with: the owned input's
        producer is a kernel of its own in the model, run before the module
        (:class:`AfterOwnedInput`)."""
        return dataclasses.replace(self, owned_input=False)

    def around(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``fn`` with the stand-ins of these neighbours around it."""
        if not (self.input_reduced_in_place or self.consumer):
            return fn

        @functools.wraps(fn)
        def with_neighbours(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            x = torch.neg(x) if self.input_reduced_in_place else x
            out = fn(x, *args, **kwargs)
            return torch.neg(out) if self.consumer else out

        return with_neighbours


def neighbours_of_site(inputs: Sequence[Any]) -> Neighbours:
    """What the call site being lowered runs between: a pointwise kernel computing its
    first input, a pointwise user of its result, or another kernel of the graph
    computing its first input for it alone.

    The producer is found as a pointwise computation, realized or not: the custom op's
    layout constraint realizes it as a copy before the lowering runs, and Inductor
    still fuses that copy with an inlined choice's first pointwise step. Any other
    buffer the graph computes (not a graph input, not a view) that only this op reads
    is an owned input: Inductor leaves out the copy an inlined all-reduce would make
    of it (comm_lowering's clone, reused in place), where a graph input is copied."""
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
    # The op's first tensor argument (its inputs are its tensor arguments, in order).
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


@dataclasses.dataclass(frozen=True)
class AfterOwnedInput:
    """A compiled choice called as a compiled benchmark module is, after the stand-in
    of the kernel that computes its owned input (Neighbours.owned_input): a kernel of
    its own, as the model's matmul is, where a pointwise producer's stand-in is
    compiled into the module."""

    module: Any
    sym_inputs: int

    def call(self, args: Sequence[Any]) -> list[torch.Tensor]:
        args = list(args)
        args[self.sym_inputs] = torch.neg(args[self.sym_inputs])
        return self.module.call(args)


def eager_module(choice: Any, neighbours: Neighbours) -> EagerModule:
    """A subgraph ``choice`` for the benchmark, its traced graph run eagerly with
    ``neighbours``' stand-ins around it: on a CPU, and on a GPU where the graph
    :func:`costs_alike_uncompiled` (collective/timing.py's timed_as_traced says when).
    A functional all-reduce of the producer's output reduces it in place, as Inductor's
    lowering does once the producer is fused into its input's copy
    (:func:`_reduced_in_place`).

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
    gm = choice.gm
    if neighbours.input_reduced_in_place and _all_reduce_of_first_input(gm) is not None:
        gm = _reduced_in_place(gm)
    return EagerModule(neighbours.around(gm), len(choice.sym_input_values))


def to_inline(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> torch.fx.GraphModule:
    """The graph of a choice that the op being lowered inlines (codegen/subgraph.py's
    inline_subgraph_to_ir_nodes, on ``inputs``): with a functional all-reduce of an
    owned first input made in place (:func:`neighbours_of_site`), what Inductor's
    reinplace pass makes of an all-reduce written in the model whose input only it
    reads. The pass runs on the model's graph before lowering and never sees a
    choice's graph, inlined while the op is lowered: without this the inlined
    all-reduce copied its input first (comm_lowering's clone), a pass over the data
    that the same all-reduce written in the model does not make (4-5% of an 8-layer
    step at 4096-16384 tokens on 2 H200s). The benchmark times it so
    (:func:`eager_module`). Any other graph, and every graph while collective
    autotuning is off, is inlined as it is."""
    from torch._inductor import config

    if not config.collective_autotune or _all_reduce_of_first_input(gm) is None:
        return gm
    if not neighbours_of_site(inputs).owned_input:
        return gm
    return _reduced_in_place(gm)


def only_calls_opaque_ops(gm: torch.fx.GraphModule) -> bool:
    """Whether Inductor would call every op of traced graph ``gm`` as it is: custom ops
    it has no lowering of its own for (it makes them fallbacks when it first lowers
    them), or ops it falls back on. Nothing of such a graph is generated as a kernel,
    and nothing fuses with it."""
    calls = _calls(gm)
    return bool(calls) and all(map(_called_as_it_is, calls))


def costs_alike_uncompiled(gm: torch.fx.GraphModule, neighbours: Neighbours) -> bool:
    """Whether :func:`eager_module` of traced graph ``gm`` with ``neighbours`` puts on
    the device, run in a CUDA graph, the work of ``gm`` compiled with them: where it
    :func:`only_calls_opaque_ops`, or calls functional collectives besides, each as
    Inductor lowers it. It also launches as many calls from the host, each stand-in or
    copy an eager op where the compiled module launches a Triton kernel.

    Inductor lowers a functional collective as the op works when called: the
    collective into a buffer of its own, ``wait_tensor`` as a wait, and
    ``all_reduce`` as ``all_reduce_`` on a copy of its input (while
    ``_collective.auto_select``, off by default, leaves it alone: that would place it
    in symmetric memory). Nothing fuses with a collective but that copy: a pointwise
    producer computes its result into it (one pass over the data, which eager_module
    gets by reducing the producer's stand-in in place: _reduced_in_place), and an
    owned input's copy is left out (the same in-place reduce). Any other copy of an
    input (of an all-reduce of a graph input, of an
    ``all_reduce_coalesced`` or a ``broadcast``) is a Triton kernel of Inductor's,
    where the op called copies with a memcpy, whose cost differs (timed as called on
    a graph input, the inlined all-reduce tied the op's own, which copies with a
    memcpy too, in graph mode on one H200).
    Such a collective, one of a value computed inside the choice (which Inductor may
    reduce in place without a copy), and one of the produced input other than its one
    all-reduce, are left to the compile. Compiling a choice that costs alike only built
    its kernels: the inlined functional all-reduce of serving_step's model in graph
    mode, the one compiled choice of four, cost its decision 0.6-0.7 s of Triton
    compiles on fresh caches on one H200."""
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
    return is_functional_collective(op) and op._schema.name.endswith("::all_reduce")


def _copies_its_inputs(op: Any) -> bool:
    """Whether Inductor lowers functional collective ``op`` as its in-place variant on
    copies of its inputs (comm_lowering's ``all_reduce``, ``all_reduce_coalesced`` and
    ``broadcast``)."""
    return op._schema.name.split("::")[1] in _COPYING_COLLECTIVES


_COPYING_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast")


def _first_input(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    return next((n for n in gm.graph.nodes if n.op == "placeholder"), None)


def _all_reduce_of_first_input(gm: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The functional all-reduce that is the only user of ``gm``'s first input (the
    call site's first input, which a producer computes), if there is one."""
    first = _first_input(gm)
    users = list(first.users) if first is not None else []
    if len(users) == 1 and _is_functional_all_reduce(users[0].target):
        return users[0]
    return None


def _reduced_in_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with the functional all-reduce of its first input made in place
    (``all_reduce_``, which a wait reads as the functional one's result): what
    Inductor runs once it has fused the producer into the all-reduce's input copy. The
    first input must be a buffer of the caller's (the producer stand-in's output).

    The graph is copied node by node and the module keeps ``gm``'s attributes (a
    deep copy would copy the fake tensors a traced choice may hold as constants)."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    rewritten = torch.fx.GraphModule(gm, graph)
    node = _all_reduce_of_first_input(rewritten)
    assert node is not None
    node.target = torch.ops._c10d_functional.all_reduce_.default
    rewritten.recompile()
    return rewritten


def _calls(gm: torch.fx.GraphModule) -> list[Any]:
    """The targets of ``gm``'s calls, tuple indexing aside."""
    import operator

    return [
        node.target
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target is not operator.getitem
    ]


def _called_as_it_is(op: Any) -> bool:
    """Whether Inductor calls ``op`` as it is: a custom op it has no lowering of its
    own for, or an op it falls back on."""
    from torch._inductor.lowering import fallbacks, lowerings

    return isinstance(op, torch._ops.OpOverload) and (
        op not in lowerings or op in fallbacks
    )


class Stage(enum.Enum):
    """How far to compile a choice for the benchmark."""

    # All the way: the module.
    COMPILE = "compile"
    # Only lowered: the lowered graph.
    LOWER = "lower"
    # Its code generated now: a function that loads the module later.
    START = "start"

    def flags(self) -> dict[str, bool]:
        """``_compile_for_benchmarking``'s arguments for this stage."""
        return {"lower_only": self is Stage.LOWER, "defer_load": self is Stage.START}


def module_for_benchmark(
    choice: Any, neighbours: Neighbours, stage: Stage = Stage.COMPILE
) -> Any:
    """A subgraph ``choice`` compiled for the benchmark at its inputs' sizes, with
    ``neighbours`` fused in (without any, as Inductor compiles its choices: no new
    trace), as far as ``stage`` says."""
    if neighbours == Neighbours():
        return choice._compile_for_benchmarking(**stage.flags())
    return compiled_module(
        choice, neighbours.around(implementation_of(choice)), False, stage
    )


def compiled_module(
    choice: Any,
    implementation: Callable[..., Any],
    symbolic: bool,
    stage: Stage = Stage.COMPILE,
) -> Any:
    """``implementation`` (a subgraph choice's, with whatever is around it) traced on
    the choice's inputs and compiled as Inductor compiles its benchmark choices, as far
    as ``stage`` says. With ``symbolic``, any guard the trace would add on the inputs'
    sizes raises instead (the module must be right at every size)."""
    from torch._inductor.ir import gm_original_output_strides

    gm, inputs = trace_on_symbolic_sizes(
        implementation, choice.decomposition_kwargs, choice.input_nodes, symbolic
    )
    gm_original_output_strides(gm)
    twin = copy.copy(choice)
    twin.gm, twin.example_inputs, twin._compiled_module = gm, inputs, None
    # Compiled as torch 2.13 compiles its choices: the lowering's guards on the sizes'
    # range (32-bit indexing, say) are the model's too.
    return twin._compile_for_benchmarking(**stage.flags())


def trace_on_symbolic_sizes(
    implementation: Callable[..., Any],
    kwargs: dict[str, Any],
    input_nodes: Sequence[Any],
    refuse_guards: bool = True,
) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """``implementation`` with ``kwargs`` traced on the symbolic sizes of IR nodes
    ``input_nodes`` (as Inductor traces its custom ops' choices since torch 2.13), and
    the example inputs it was traced on. With ``refuse_guards``, a guard the trace would
    add on the sizes raises instead (``symbolic_shapes._ShapeEnvGuardError``): the
    graph must be right at every size."""
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
