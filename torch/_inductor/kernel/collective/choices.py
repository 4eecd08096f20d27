"""A collective op's choices as every rank names and screens them alike.

Ranks vote by name: :func:`choice_label` names a choice by its implementation and its
config's parameters, and the op's own implementation is :data:`DEFAULT`. A choice that
cannot be used says why (:func:`trace_failure`) from what tracing shows on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import types
from collections.abc import Callable, Sequence
from typing import Any, TYPE_CHECKING

import torch
from torch._inductor.kernel.collective.detection import (
    lowered_call_names_a_group,
    op_name,
    uses_symmetric_memory,
)
from torch._inductor.kernel.collective.graph_state import (
    function_memo,
    graph_state,
    recorded_memo,
    TraceState,
)
from torch._inductor.kernel.collective.in_place import untraceable_collective
from torch._inductor.kernel.collective.records import cleared_with_inductor_caches
from torch._inductor.kernel.collective.waits import (
    is_functional_collective,
    is_wait,
    OwnImplementation,
    Waits,
    dispatchable,
    recorded_own_waits,
    trace_own_implementation,
    wait_for_output,
    waited_call,
    with_waits,
)
from torch._inductor.runtime.collective_decisions import digest
from torch._inductor.runtime.collective_protocol import describe
from torch.utils._pytree import tree_map_only

if TYPE_CHECKING:
    from torch._inductor.ir import ChoiceCaller


log = logging.getLogger(__name__)

# The label of the op's own implementation among its choices.
DEFAULT = "default"


# Not user code: it changes only with torch or Python, which every key names already.
_NOT_USER_CODE = (
    "torch",
    "builtins",
    "functools",
    "typing",
    "math",
    "operator",
    "collections",
)
# Bounds the functions one identity follows (a call graph can be large).
_MOST_FUNCTIONS = 64


def code_identity(fn: Callable[..., Any]) -> str:
    """A digest of the code ``fn`` runs: its bytecode, defaults, simple closure values,
    and the user functions and custom-op kernels it reaches. Any change is a new one."""
    parts: list[Any] = []
    _digest_into(fn, parts, set())
    return digest(repr(parts))


def _digest_into(fn: Any, parts: list[Any], seen: set[int]) -> None:
    if id(fn) in seen or len(seen) >= _MOST_FUNCTIONS:
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        parts.append(("partial", repr(fn.args), repr(sorted(fn.keywords.items()))))
        _digest_into(fn.func, parts, seen)
        return
    fn = inspect.unwrap(fn)
    if isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = (
            fn._qualified_op_name
            if isinstance(fn, torch._ops.OpOverloadPacket)
            else fn.name()
        )
        parts.append(("op", name))
        kernel = _python_kernel(name.split(".")[0])
        if kernel is not None:
            _digest_into(kernel, parts, seen)
        return
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        parts.append(("object", type(fn).__qualname__))
        return
    parts.append(
        (
            fn.__module__,
            fn.__qualname__,
            _code(code),
            _simple(fn.__defaults__),
            _simple(fn.__kwdefaults__),
        )
    )
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(value):
            _digest_into(value, parts, seen)
        else:
            parts.append(_simple(value))
    for name in _names(code):
        value = fn.__globals__.get(name)
        if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or (
            isinstance(value, types.FunctionType)
            and not str(value.__module__).startswith(_NOT_USER_CODE)
        ):
            _digest_into(value, parts, seen)


def _code(code: types.CodeType) -> tuple[Any, ...]:
    consts = tuple(
        _code(c) if isinstance(c, types.CodeType) else _simple(c)
        for c in code.co_consts
    )
    return code.co_code, consts, code.co_names


def _names(code: types.CodeType) -> list[str]:
    """The global names ``code`` and the code nested in it read."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _names(const)
    return names


def _simple(value: Any) -> Any:
    """Plain data as it is, other objects by type (a repr may hold an address)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_simple(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _simple(v)) for k, v in value.items()))
    return type(value).__qualname__


def _python_kernel(qualname: str) -> Callable[..., Any] | None:
    """The Python function of a custom op defined with torch.library.custom_op."""
    from torch._library.custom_ops import OPDEFS

    definition = OPDEFS.get(qualname)
    return getattr(definition, "_init_fn", None)


# For the process, on purpose, as upstream keeps lowerings: registration happens once,
# so fresh_cache must not forget ops.
_may_communicate: dict[str, bool] = {}
_registered_identities: dict[str, str] = {}
# For the process until fresh_cache, on purpose, not per graph: identities seen at any
# compile since Inductor's caches were cleared, which cached graphs must match.
_identities: dict[str, str] = cleared_with_inductor_caches({})


def register(
    op: torch._ops.OpOverload, configs: Sequence[Any], may_communicate: bool
) -> None:
    """Note an op registered for autotuning and, if it may communicate (its calls
    tell), its code."""
    _may_communicate[op_name(op)] = may_communicate
    if may_communicate:
        schema = schema_arguments(op)
        registered = identities(
            op,
            [
                (label(c.decomposition.__name__, c.params, schema), c.decomposition)
                for c in configs
                if c.decomposition is not None
            ],
        )
        _registered_identities.update(registered)


def registered_and_may_communicate(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` was registered for autotuning and may communicate."""
    return _may_communicate.get(op_name(op), False)


def identities(
    op: torch._ops.OpOverload | None,
    implementations: Sequence[tuple[str, Callable[..., Any]]],
) -> dict[str, str]:
    """Record and return the code identities of ``op`` and its ``implementations``."""
    name = op_name(op) if op is not None else ""
    seen = {f"{name}/{DEFAULT}": code_identity(op)} if op is not None else {}
    seen.update({f"{name}/{lbl}": code_identity(fn) for lbl, fn in implementations})
    _identities.update(seen)
    return seen


def current_identity(name: str) -> str | None:
    """``name``'s code identity as last seen (compile, else registration), or None."""
    return _identities.get(name, _registered_identities.get(name))


def schema_arguments(op: torch._ops.OpOverload | None) -> set[str]:
    """The names of ``op``'s arguments (none for an op without a schema)."""
    return {a.name for a in op._schema.arguments} if hasattr(op, "_schema") else set()


def choice_label(choice: ChoiceCaller, op: torch._ops.OpOverload | None = None) -> str:
    """A choice's name, alike on every rank: its implementation and its config's
    parameters (``chunked_all_reduce(chunks=4)``), or :data:`DEFAULT`."""
    decomposition = getattr(choice, "decomposition", None)
    if getattr(choice, "gm", None) is None or decomposition is None:
        return DEFAULT
    return label(
        decomposition.__name__,
        getattr(choice, "decomposition_kwargs", {}),
        schema_arguments(op),
    )


def label(implementation: str, kwargs: dict[str, Any], schema: set[str]) -> str:
    """``implementation``'s label with ``kwargs``, less the op's own (``schema``)."""
    params = {k: v for k, v in sorted(kwargs.items()) if k not in schema}
    if not params:
        return implementation
    return f"{implementation}({', '.join(f'{k}={v!r}' for k, v in params.items())})"


def the_op_itself(
    op: torch._ops.OpOverload, schema: set[str], waits: Waits = Waits.NONE
) -> Callable[..., Any]:
    """A stand-in implementation (never chosen): the op's own call, with a wait where
    ``waits`` says (resolved early: Dynamo, tracing a size dispatch, cannot)."""
    call = waited_call(op, waits)

    def the_op_itself(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **{k: v for k, v in kwargs.items() if k in schema})

    return the_op_itself


def check_own_implementation(
    op: torch._ops.OpOverload,
    inputs: Sequence[Any],
    non_tensor_args: Sequence[dict[str, Any]],
) -> OwnImplementation:
    """What the op's own implementation does with functional collectives on IR
    ``inputs``; raises as waits.trace_own_implementation does."""
    body = _python_kernel(op_name(op))
    if body is None:
        return OwnImplementation()
    names = schema_arguments(op)
    kwargs = {k: v for k, v in (non_tensor_args or [{}])[0].items() if k in names}
    return trace_own_implementation(op, body, inputs, kwargs)


def call_arguments(
    op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The arguments, by name, of a call of ``op`` being lowered that are no IR node."""
    names = [a.name for a in op._schema.arguments]
    positional = {
        name: value
        for name, value in zip(names, args)
        if not hasattr(value, "get_size")
    }
    return {**positional, **kwargs}


def own_output(own: OwnImplementation, out: Any) -> Any:
    """``out``, the op's own lowered call, then a wait where ``own`` needs one."""
    from torch._inductor.ir import TensorBox

    if own.waits is not Waits.OUTPUT:
        return out
    return tree_map_only(TensorBox, wait_for_output, out)


def own_waits(op: torch._ops.OpOverload | None) -> Waits:
    """What :func:`check_own_implementation` found for ``op`` in this process."""
    return recorded_own_waits(_python_kernel(op_name(op)) if op is not None else None)


def _trace_state(fn: Any) -> TraceState | None:
    """What tracing ``fn`` showed, where it is a wrapper this module made (traces are
    kept for those, never for users' callables); else None."""
    memo = recorded_memo(fn)
    return memo.trace if memo is not None else None


def guarded_implementation(
    decomposition: Callable[..., Any], op: torch._ops.OpOverload
) -> Callable[..., Any]:
    """``decomposition`` with the waits it left out, traced as the op itself where it
    raises (:func:`trace_failure` then reports it)."""
    from torch.fx.experimental import symbolic_shapes

    # Upstream skips implementations that add guards, alike on every rank: re-raise.
    guard_errors = (symbolic_shapes._ShapeEnvGuardError, AssertionError)
    instead = the_op_itself(op, schema_arguments(op))
    waited = with_waits(decomposition, op)
    state = TraceState(traces=_shared_traces(decomposition, op))

    @functools.wraps(waited)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return waited(*args, **kwargs)
        except guard_errors:
            raise
        except Exception as e:  # reported to the group by the choice
            state.failure = describe(e)
            log.debug(
                "implementation %s raised while traced",
                decomposition.__name__,
                exc_info=True,
            )
            return instead(*args, **kwargs)

    function_memo(guarded).trace = state
    return guarded


def _shared_traces(
    decomposition: Callable[..., Any], op: torch._ops.OpOverload
) -> dict[Any, Any] | None:
    """traced_once's traces of ``decomposition``; None unless tuned collectively."""
    from torch._inductor import config

    if not (config.collective_autotune and lowered_call_names_a_group(op)):
        return None
    return graph_state().traces.setdefault((decomposition, op), {})


def traced_once(
    trace: Callable[..., torch.fx.GraphModule],
    implementation: Callable[..., Any],
    kwargs: dict[str, Any],
    input_nodes: Sequence[Any],
) -> Callable[..., torch.fx.GraphModule]:
    """Upstream's ``trace`` of a collective op's choice, made once per graph and input
    layout: later calls copy it, so a model's layers do not trace the winner again."""
    state = _trace_state(implementation)
    if state is None or state.traces is None:
        return trace

    def once(*inputs: Any) -> torch.fx.GraphModule:
        from torch._inductor.virtualized import V
        from torch.fx.experimental.symbolic_shapes import free_symbols

        # A new guard of the graph's shape environment may change what a trace takes.
        site = (
            repr(sorted(kwargs.items())),
            tuple(map(layout_of, input_nodes)),
            len(V.graph.sizevars.shape_env.guards),
        )
        if not free_symbols(list(inputs)) and free_symbols(
            [n.get_size() for n in input_nodes]
        ):
            # torch 2.11 traces each range of a ladder at the range's size.
            generic = _traced_on_site_sizes(
                state, site, implementation, kwargs, input_nodes
            )
            if generic is not None:
                return generic
            site = (*site, _layouts(inputs))
        return _shared_trace(state, site, lambda: trace(*inputs))

    return once


def _shared_trace(
    state: TraceState, key: Any, trace_now: Callable[[], torch.fx.GraphModule]
) -> torch.fx.GraphModule:
    """A copy of the trace under ``key`` (``trace_now`` makes it), with its marks."""
    from torch._dynamo.utils import counters

    assert state.traces is not None
    if key not in state.traces:
        # Kept with the trace: its own marks, not layout inference's before it.
        marked, state.failure = state.failure, ""
        try:
            state.traces[key] = (trace_now(), state.failure)
        finally:
            state.failure = state.failure or marked
        counters["inductor"]["collective_autotune_choice_traces"] += 1
    gm, failure = state.traces[key]
    state.failure = state.failure or failure
    return copied_graph(gm)


def _traced_on_site_sizes(
    state: TraceState,
    site: tuple[Any, ...],
    implementation: Callable[..., Any],
    kwargs: dict[str, Any],
    input_nodes: Sequence[Any],
) -> torch.fx.GraphModule | None:
    """The trace on the site's symbolic sizes, shared by every range; None where that
    trace guards the sizes or fails (each range is then traced at its size)."""
    from torch._inductor.kernel.collective.choice_modules import (
        trace_on_symbolic_sizes,
    )

    assert state.traces is not None
    refused = (*site, "guards the site's sizes")
    if refused in state.traces:
        return None
    try:
        return _shared_trace(
            state,
            site,
            lambda: trace_on_symbolic_sizes(implementation, kwargs, input_nodes)[0],
        )
    except Exception:
        log.debug(
            "%s is traced at each range's size", implementation.__name__, exc_info=True
        )
        state.traces[refused] = None
        return None


def layout_of(node: Any) -> tuple[Any, ...]:
    """What a module traced on IR ``node`` depends on: size, stride, dtype, device."""
    return (
        str(node.get_size()),
        str(node.get_stride()),
        node.get_dtype(),
        node.get_device(),
    )


def _layouts(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What a trace on example ``inputs`` depends on."""
    return tuple(
        (str(t.shape), str(t.stride()), t.dtype, t.device)
        if isinstance(t, torch.Tensor)
        else repr(t)
        for t in inputs
    )


def copied_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with a copy of its graph (metadata copied shallowly), to change."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def trace_failure(choice: ChoiceCaller) -> str:
    """Why ``choice`` cannot be used, as tracing shows alike on every rank, or ""."""
    state = _trace_state(getattr(choice, "decomposition", None))
    gm = getattr(choice, "gm", None)
    return (
        (state.failure if state else "")
        or untraceable_collective(gm)
        or unwaited_collective(gm)
    )


def unwaited_collective(gm: torch.fx.GraphModule | None) -> str:
    """Why ``gm`` reads a functional collective's output (or in-place input) before
    ``wait_tensor``, or "": such a read races with it, differing between ranks."""
    if gm is None:
        return ""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        target = node.target
        if not is_functional_collective(target):
            continue
        written = [node]
        if target._schema.is_mutable:
            written += [a for a in node.args if isinstance(a, torch.fx.Node)]
        for tensor in written:
            for user in tensor.users:
                if (
                    user is not node
                    and not is_wait(user.target)
                    and order[user] > order[node]
                    and not any(
                        is_wait(w.target) and order[w] < order[user] for w in node.users
                    )
                ):
                    return (
                        f"reads the output of {target.name()} before wait_tensor "
                        f"(in {user.name}): its result races with the communication"
                    )
    return ""


def writes_into_input(gm: torch.fx.GraphModule | None, mutable: Sequence[int]) -> str:
    """Why ``gm`` writes into a tensor input (or a view of one) that the op does not
    declare mutable (``mutable`` positions), or "": inlined, it changes the caller's."""
    if gm is None:
        return ""
    tensors = [
        n
        for n in gm.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
    ]
    origin = {node: i for i, node in enumerate(tensors)}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(
            node.target, torch._ops.OpOverload
        ):
            continue
        schema = node.target._schema
        for argument, value in zip(schema.arguments, node.args):
            if not (
                isinstance(value, torch.fx.Node)
                and value in origin
                and argument.alias_info is not None
            ):
                continue
            if argument.alias_info.is_write and origin[value] not in mutable:
                return (
                    f"writes into input {origin[value]} ({node.target.name()}), "
                    "which the op does not declare it mutates"
                )
            if any(r.alias_info is not None for r in schema.returns):
                origin[node] = origin[value]
    return ""


def needs_symmetric_memory(choice: ChoiceCaller) -> bool:
    """Whether ``choice``'s traced graph calls symmetric-memory ops."""
    gm = getattr(choice, "gm", None)
    return gm is not None and any(
        node.op == "call_function" and uses_symmetric_memory(node.target)
        for node in gm.graph.nodes
        if isinstance(node.target, torch._ops.OpOverload)
    )


def default_choice(choices: Sequence[ChoiceCaller]) -> ChoiceCaller:
    """The op's own implementation (the extern fallback choice), else the first."""
    from torch._inductor.select_algorithm import ExternKernelCaller

    return next((c for c in choices if isinstance(c, ExternKernelCaller)), choices[0])


# torch 2.11: one per autotune name for the process, on purpose (fresh_cache keeps
# them), since an ExternKernelChoice registers its name with Inductor for good.
_default_choices: dict[str, Any] = {}


def complete_default_choice(
    name: str,
    choices: list[ChoiceCaller],
    op: torch._ops.OpOverload,
    non_tensor_args: Sequence[dict[str, Any]],
) -> None:
    """Make the op's own implementation a complete choice at every compile: every rank
    falls back to it, so all must list it alike. torch 2.11 appends it only at the op's
    first compile and without the non-tensor arguments, which are bound here."""
    from torch._inductor.select_algorithm import ExternKernelCaller, ExternKernelChoice

    names = schema_arguments(op)
    kwargs = {k: v for k, v in (non_tensor_args or [{}])[0].items() if k in names}
    default = default_choice(choices)
    if isinstance(default, ExternKernelCaller):
        if not default.kwargs:
            default.kwargs = kwargs
        return
    if not hasattr(op, "_op"):  # not an OpOverload: nothing to call
        return
    if name not in _default_choices:
        _default_choices[name] = ExternKernelChoice(
            op,
            name=f"{name}_collective_fallback",
            has_out_variant=False,
            op_overload=op,
            use_fallback_kernel=True,
        )
    template = choices[0]
    default = _default_choices[name].bind(
        template.input_nodes, template.layout, **kwargs
    )
    default.name = f"{name}_fallback_default"
    choices.append(default)


@dataclasses.dataclass(frozen=True)
class RangeWinner:
    """A range's winner as the range-based lowering reads it: what to dispatch to, no
    graph (an inlined collective would run at every call). ``decomposition`` is the op
    itself for its own implementation; ``default``, its choice where traced."""

    name: str
    decomposition: Callable[..., Any]
    decomposition_kwargs: dict[str, Any]
    config_patches: dict[str, Any]
    default: ChoiceCaller | None = None
    gm: None = None

    @staticmethod
    def of(choice: ChoiceCaller, default: ChoiceCaller) -> RangeWinner:
        """The range winner ``choice`` (one of the range's traced choices)."""
        decomposition = getattr(choice, "decomposition", None)
        op = getattr(getattr(default, "choice", None), "op_overload", None)
        return RangeWinner.create(
            choice.name,
            decomposition,
            getattr(choice, "decomposition_kwargs", {}),
            getattr(choice, "config_patches", None),
            op,
            default,
        )

    @staticmethod
    def create(
        name: str,
        decomposition: Callable[..., Any] | None,
        kwargs: dict[str, Any],
        config_patches: dict[str, Any] | None,
        op: torch._ops.OpOverload | None,
        default: ChoiceCaller | None = None,
    ) -> RangeWinner:
        """The range winner ``decomposition`` (None: the op's own implementation)."""
        if decomposition is None:
            own = the_op_itself(op, schema_arguments(op), own_waits(op))
            return RangeWinner(name, own, {}, config_patches or {}, default)
        return RangeWinner(
            name,
            _sharing_traces(dispatchable(decomposition), decomposition),
            kwargs,
            config_patches or {},
            default,
        )

    def output_node(self) -> Any:
        # Unused by the range-based lowering, so removed with the graph's dead code.
        return self.default.output_node() if self.default else None


def _sharing_traces(
    implementation: Callable[..., Any], guarded: Callable[..., Any]
) -> Callable[..., Any]:
    """``implementation`` (what a size dispatch calls) sharing the traces of its
    ``guarded`` twin, so a sole winner of every range is traced once per graph."""
    state = _trace_state(guarded)
    if state is None or state.traces is None:  # tuning is off, or not a collective
        return implementation

    @functools.wraps(implementation)
    def shared(*args: Any, **kwargs: Any) -> Any:
        return implementation(*args, **kwargs)

    function_memo(shared).trace = TraceState(traces=state.traces)
    return shared


@dataclasses.dataclass(frozen=True)
class Implementations:
    """A call site's implementations as upstream's custom_op hands them over: each
    decomposition with its arguments and config patches."""

    op: torch._ops.OpOverload
    decompositions: Sequence[Callable[..., Any]]
    non_tensor_args: Sequence[dict[str, Any]]
    config_patches: Sequence[dict[str, Any]] | None = None

    def labels(self) -> list[str]:
        """The labels of the implementations, as records and logs name them."""
        schema = schema_arguments(self.op)
        return [
            label(d.__name__, kwargs, schema)
            for d, kwargs in zip(self.decompositions, self.non_tensor_args)
        ]

    def as_given(
        self,
    ) -> tuple[list[Callable[..., Any]], list[dict[str, Any]], list[Any] | None]:
        return (
            list(self.decompositions),
            list(self.non_tensor_args),
            None if self.config_patches is None else list(self.config_patches),
        )

    def to_trace(
        self, winner: str | None, among: Sequence[str] | None = None
    ) -> tuple[list[Callable[..., Any]], list[dict[str, Any]], list[Any] | None]:
        """The implementations to trace, guarded, with their arguments and config
        patches: those ``among`` (default all), or only the ``winner`` the group
        decided already. Upstream gives the op's own the first one's arguments: the
        first stays, traced cheaply as the op itself where it is not wanted."""
        labels = self.labels()
        wanted = {winner} if winner is not None else set(among or labels)
        keep = [i for i, name in enumerate(labels) if i == 0 or name in wanted]
        traced = [guarded_implementation(d, self.op) for d in self.decompositions]
        if labels[0] not in wanted:
            traced[0] = the_op_itself(self.op, schema_arguments(self.op))

        def kept(items: Sequence[Any] | None) -> Any:
            return None if items is None else [items[i] for i in keep]

        return kept(traced), kept(self.non_tensor_args), kept(self.config_patches)

    def winner(self, winner: str) -> RangeWinner:
        """A decided ``winner``, untraced: its implementation, or the op's own."""
        labels = self.labels()
        if winner not in labels:
            return RangeWinner.create(winner, None, {}, None, self.op)
        i = labels.index(winner)
        return RangeWinner.create(
            winner,
            guarded_implementation(self.decompositions[i], self.op),
            self.non_tensor_args[i],
            None if self.config_patches is None else self.config_patches[i],
            self.op,
        )
