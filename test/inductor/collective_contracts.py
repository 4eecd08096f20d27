"""Every upstream assumption of collective autotuning, stated once and checked.

Each :class:`Contract` names one internal of torch that the patch relies on (a name it
imports, a signature it calls, a class it recognises, or what one of the overlay's
edits does), which of our modules relies on it, how to check it, and how upstream
could break it (``breaks``: the same internal as a change upstream would leave it).
When torch moves, a contract fails and says which assumption; nothing of ours goes
silently dead.

* ``test_collective_autotuning_contracts.py`` runs every contract as a test, and shows
  that each one fails once its assumption is broken.
* ``python test/inductor/collective_contracts.py`` prints one line per contract and
  exits 1 if any fails: ``tools/overlay.py check`` runs it with the torch being
  checked. Contracts about what the overlay's edits do need the overlay applied;
  without it they are reported as not checked.

Effects are checked on CPU, in one process, on real lowered graphs (a process group of
one rank where one is needed); contracts about CUDA-only internals run where CUDA is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Iterator
from unittest import mock

import torch


class ContractBroken(AssertionError):
    """An upstream internal is not what the patch assumes."""


@dataclasses.dataclass(frozen=True)
class Contract:
    """One upstream assumption: what is assumed, who relies on it, how it is checked,
    and a change upstream that breaks it."""

    name: str
    used_by: str
    check: Callable[[], None]
    breaks: Callable[[], contextlib.AbstractContextManager[Any]]
    # Whether it checks what one of the overlay's edits does (the overlay must be applied).
    needs_overlay: bool = False
    needs_cuda: bool = False

    def verify(self) -> None:
        """Check the contract; raise ContractBroken naming it, whatever went wrong."""
        try:
            self.check()
        except ContractBroken as e:
            raise ContractBroken(f"{self.name}: {e}") from e
        except Exception as e:  # noqa: BLE001 - a broken assumption may show as any error
            raise ContractBroken(f"{self.name}: {type(e).__name__}: {e}") from e


# -- helpers ---------------------------------------------------------------------------------


def resolve(path: str) -> Any:
    """The object at dotted ``path`` (a module, then attributes)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def has(path: str, *parameters: str) -> Callable[[], None]:
    """A check that ``path`` exists and, if ``parameters`` are given, is a callable
    that takes them by those names."""

    def check() -> None:
        try:
            obj = resolve(path)
        except (ImportError, AttributeError) as e:
            raise ContractBroken(f"{path} is gone: {type(e).__name__}: {e}") from e
        if parameters:
            accepted = inspect.signature(obj).parameters
            missing = [p for p in parameters if p not in accepted]
            if missing:
                raise ContractBroken(f"{path} no longer takes {missing}; it takes {list(accepted)}")

    return check


def without(path: str) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What a removal of ``path`` upstream would leave."""
    owner, attr = path.rsplit(".", 1)

    @contextlib.contextmanager
    def broken() -> Iterator[None]:
        target = resolve(owner)
        saved = target.__dict__[attr] if attr in getattr(target, "__dict__", {}) else getattr(target, attr)
        delattr(target, attr)
        try:
            yield
        finally:
            setattr(target, attr, saved)

    return broken


def replaced(path: str, value: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What ``path`` replaced by ``value`` upstream would leave."""
    owner, attr = path.rsplit(".", 1)
    return lambda: mock.patch.object(resolve(owner), attr, value)


def overlay_applied() -> bool:
    try:
        importlib.import_module("torch._inductor.kernel.collective.hooks")
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def one_rank_group() -> Iterator[Any]:
    """A gloo process group of this process alone, on a Store in memory."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group(
            "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60)
        )
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def fresh_inductor() -> Iterator[None]:
    """Compiles from scratch, in a cache dir of their own."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with fresh_cache():
        yield
    torch._dynamo.reset()


@contextlib.contextmanager
def scheduled_graphs() -> Iterator[list[Any]]:
    """The schedulers (and their graph's CUDA-graph verdict) of the compiles in the
    block: each Scheduler as its __init__ left it."""
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.virtualized import V

    seen: list[Any] = []
    original = Scheduler.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        seen.append((self, V.graph.disable_cudagraphs_reason))

    with mock.patch.object(Scheduler, "__init__", init):
        yield seen


def _switch_class() -> type:
    from torch._inductor import ir

    # torch 2.14 merged ir.Conditional into ir.Switch.
    return getattr(ir, "Switch", None) or ir.Conditional


def _size_and_data_conds() -> tuple[Any, Any]:
    def size_cond(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.size(0) <= 4, lambda t: t * 2, lambda t: t + 1, (x,))

    def data_cond(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t * 2, lambda t: t + 1, (x,))

    return size_cond, data_cond


def _lowered_conds() -> dict[str, tuple[Any, Any, Any]]:
    """A cond over a size and one over data, each compiled on CPU as if its operands
    were on a GPU and the model ran under CUDA graphs: (scheduler, its Switch node,
    the graph's CUDA-graph verdict)."""
    from torch._inductor import config

    found = {}
    for name, fn in zip(("size", "data"), _size_and_data_conds()):
        with fresh_inductor(), scheduled_graphs() as seen, config.patch(
            {"triton.cudagraphs": True, "graph_partition": True}
        ), mock.patch("torch._inductor.lowering.is_triton", lambda x: True):
            x = torch.randn(6, 3)
            torch._dynamo.mark_dynamic(x, 0)
            torch.compile(fn, fullgraph=True)(x)
        for scheduler, reason in seen:
            nodes = [n for n in scheduler.nodes if isinstance(getattr(n, "node", None), _switch_class())]
            if nodes:
                found[name] = (scheduler, nodes[0], reason)
    if set(found) != {"size", "data"}:
        raise ContractBroken(f"no Switch/Conditional node was scheduled for the conds: {sorted(found)}")
    return found


# -- the effects of the overlay's edits ---------------------------------------------------------


def check_size_predicate_keeps_partitions() -> None:
    """Scheduler.should_partition keeps a cond whose predicate reads sizes only inside a
    CUDA-graph partition (the size dispatch), and still partitions at a data predicate."""
    from torch._inductor import config
    from torch._inductor.scheduler import Scheduler

    for name, (scheduler, node, _) in _lowered_conds().items():
        with config.patch({"triton.cudagraphs": True, "graph_partition": True}), mock.patch.object(
            node, "is_gpu", lambda: True
        ):
            verdict = Scheduler.should_partition(scheduler, node)
        if name == "size" and verdict is not None:
            raise ContractBroken(f"a size dispatch is partitioned out of CUDA graphs: {verdict!r}")
        if name == "data" and verdict is None:
            raise ContractBroken("a cond over device data is no longer partitioned: the rule changed")


def check_size_predicate_keeps_cudagraphs() -> None:
    """The cond lowering keeps CUDA graphs on for a predicate over sizes only, and turns
    them off for one over device data."""
    conds = _lowered_conds()
    if conds["size"][2] is not None:
        raise ContractBroken(f"a size dispatch turns CUDA graphs off: {conds['size'][2]!r}")
    if conds["data"][2] is None:
        raise ContractBroken("a cond over device data no longer turns CUDA graphs off: the rule changed")


def break_partitioner() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.scheduler import Scheduler

    original = Scheduler.should_partition

    def should_partition(self: Any, node: Any) -> Any:
        if isinstance(getattr(node, "node", None), _switch_class()):
            return "Switch ops"
        return original(self, node)

    return mock.patch.object(Scheduler, "should_partition", should_partition)


def break_cond_lowering() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import lowering

    original = lowering.lowerings[torch.ops.higher_order.cond]

    def cond(*args: Any, **kwargs: Any) -> Any:
        from torch._inductor.virtualized import V

        V.graph.disable_cudagraphs_reason = "control flow operator: torch.cond."
        return original(*args, **kwargs)

    return mock.patch.dict(lowering.lowerings, {torch.ops.higher_order.cond: cond})


def check_cache_hits_pass_the_gate() -> None:
    """FxGraphCache.cache_hit_post_compile asks the collective gate about every hit,
    with the decisions the compiled graph records (CompiledFxGraph.collective_decisions)."""
    from torch._inductor import config
    from torch._inductor.kernel.collective import hooks

    asked: list[Any] = []

    def gate(decisions: Any) -> bool:
        asked.append(decisions)
        return True

    with fresh_inductor(), config.patch(fx_graph_cache=True), mock.patch.object(
        hooks, "cached_graph_may_load", gate
    ):
        for _ in range(2):  # a miss, then a hit
            torch._dynamo.reset()
            torch.compile(lambda x: x.sin() + 1, fullgraph=True)(torch.randn(4))
    if not asked or not isinstance(asked[0], tuple):
        raise ContractBroken(f"a cache hit did not ask the collective gate (asked: {asked})")


def break_cache_hits() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.codecache import FxGraphCache

    def hit(graph: Any, cache_info: Any, constants: Any) -> Any:
        graph.after_deserialization(constants)
        return graph, cache_info

    return mock.patch.object(FxGraphCache, "cache_hit_post_compile", staticmethod(hit))


def check_compiled_graphs_record_decisions() -> None:
    """CompiledFxGraph has a collective_decisions field, filled from the graph lowered."""
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.output_code import CompiledFxGraph

    if "collective_decisions" not in {f.name for f in dataclasses.fields(CompiledFxGraph)}:
        raise ContractBroken("CompiledFxGraph has no collective_decisions field")
    graphs: list[Any] = []
    original = hooks.inlined_decisions

    def spy(graph: Any) -> Any:
        graphs.append(graph)
        return original(graph)

    with fresh_inductor(), mock.patch.object(hooks, "inlined_decisions", spy):
        torch.compile(lambda x: x.cos() * 2, fullgraph=True)(torch.randn(4))
    if not graphs:
        raise ContractBroken("a compiled graph no longer records its collective decisions")


def break_compiled_graphs() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.output_code import CompiledFxGraph

    original = CompiledFxGraph.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        from torch._inductor.kernel.collective import hooks

        with mock.patch.object(hooks, "inlined_decisions", lambda graph: ()):
            original(self, *args, **kwargs)

    return mock.patch.object(CompiledFxGraph, "__init__", init)


def one_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The contracts' collective ops' one implementation with a graph (its name is its
    choice's label)."""
    fc = torch.ops._c10d_functional
    return fc.wait_tensor(fc.all_reduce(x, "sum", group_name))


def check_collectives_reach_the_selector() -> None:
    """register_custom_op_autotuning notes the op (hooks.note_registration),
    and AlgorithmSelectorCache hands a collective op to select_collective_choice."""
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.kernel.custom_op import CustomOpConfig, register_custom_op_autotuning

    custom_op = _contract_all_reduce()
    op = torch.ops.collective_contract.all_reduce.default
    noted: list[Any] = []
    selected: list[Any] = []
    note, select = hooks.note_registration, hooks.select_collective_choice
    with mock.patch.object(hooks, "note_registration", lambda *a: noted.append(a) or note(*a)):
        # torch 2.11 takes the decorated function only; later torch its OpOverload too.
        register_custom_op_autotuning(custom_op, configs=[CustomOpConfig(one_all_reduce)])
    with one_rank_group() as group, fresh_inductor(), mock.patch.object(
        hooks, "select_collective_choice", lambda *a, **k: selected.append(a) or select(*a, **k)
    ):
        torch.compile(lambda x: op(x, group.group_name) + 1, fullgraph=True)(torch.randn(4, 4))
    if not noted:
        raise ContractBroken("register_custom_op_autotuning no longer calls note_registration")
    if not selected:
        raise ContractBroken("a collective op's selection no longer reaches select_collective_choice")


@functools.cache
def _contract_all_reduce() -> Any:
    """A collective custom op of the contracts' own."""

    @torch.library.custom_op("collective_contract::all_reduce", mutates_args=())
    def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return x.clone()

    @all_reduce.register_fake
    def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return torch.empty_like(x)

    return all_reduce


def check_winners_with_a_graph_are_inlined() -> None:
    """custom_op inlines a winner that has a graph (inline_subgraph_to_ir_nodes) and
    returns that, never the node the selector returned with it: the diff's selector
    returns none for such a winner rather than lowering one to be thrown away."""
    from torch._inductor.codegen import subgraph
    from torch._inductor.kernel.custom_op import CustomOpConfig, register_custom_op_autotuning

    custom_op = _contract_slow_all_reduce()
    op = torch.ops.collective_contract.slow_all_reduce.default
    register_custom_op_autotuning(custom_op, configs=[CustomOpConfig(one_all_reduce)])
    inlined: list[Any] = []
    inline = subgraph.inline_subgraph_to_ir_nodes
    with one_rank_group() as group, fresh_inductor(), mock.patch.object(
        subgraph, "inline_subgraph_to_ir_nodes", lambda *a, **k: inlined.append(a) or inline(*a, **k)
    ):
        x = torch.randn(4, 4)
        compiled = torch.compile(lambda x: op(x, group.group_name) + 1, fullgraph=True)
        compiled(x)  # compiles: the choices are timed, the op's own included
        _SLOW_ALL_REDUCE_CALLS.clear()
        out = compiled(x)
    if not inlined:
        raise ContractBroken("custom_op no longer inlines a winner that has a graph")
    if _SLOW_ALL_REDUCE_CALLS:
        # torch 2.14 lowers an op whose lowering returned nothing as the op itself.
        raise ContractBroken("the compiled graph calls the op's own implementation, not the winner")
    if not torch.equal(out, x + 1):  # one rank: the all-reduce of x is x
        raise ContractBroken("the compiled graph does not compute the inlined winner")


# Calls of slow_all_reduce's own implementation.
_SLOW_ALL_REDUCE_CALLS: list[None] = []


@functools.cache
def _contract_slow_all_reduce() -> Any:
    """A collective custom op whose own implementation loses to any other: its only
    other choice, which has a graph, wins."""

    @torch.library.custom_op("collective_contract::slow_all_reduce", mutates_args=())
    def slow_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
        _SLOW_ALL_REDUCE_CALLS.append(None)
        time.sleep(0.02)
        return x.clone()

    @slow_all_reduce.register_fake
    def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return torch.empty_like(x)

    return slow_all_reduce


def break_selector() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.select_algorithm import AlgorithmSelectorCache

    # A selector that no longer hands collectives over (it takes the first choice: its
    # own benchmarking of a gloo collective would deadlock while lowering).
    def call(self: Any, name: str, choices: list[Any], *args: Any, **kwargs: Any) -> Any:
        return choices[0].output_node(), choices[0]

    return mock.patch.object(AlgorithmSelectorCache, "__call__", call)


# -- the effects of upstream internals the patch uses as they are ---------------------------------


def check_guards_are_refused() -> None:
    """ShapeEnv.error_on_new_guards makes a guard raise _ShapeEnvGuardError, leaving none
    behind (backported to torch 2.11 by the overlay)."""
    from torch.fx.experimental.symbolic_shapes import _ShapeEnvGuardError, ShapeEnv

    env = ShapeEnv()
    size = env.create_symintnode(env.create_symbol(8, source=_source()), hint=8)
    guards = len(env.guards)
    try:
        with env.error_on_new_guards():
            bool(size > 4)
    except _ShapeEnvGuardError:
        if len(env.guards) != guards:
            raise ContractBroken("a refused guard was still added") from None
        return
    raise ContractBroken("a guard inside error_on_new_guards() did not raise")


def _source() -> Any:
    from torch._dynamo.source import ConstantSource

    return ConstantSource("collective_contract_size")


def check_compile_callbacks_fire() -> None:
    """torch._dynamo.callback.callback_handler runs registered start and end callbacks
    around a compile, and torch._dynamo.reset() drops them (collective/dynamo_callbacks.py
    beats while Dynamo compiles, and installs them again after a reset)."""
    from torch._dynamo.callback import callback_handler

    fired: list[str] = []

    def start(*args: Any) -> None:
        fired.append("start")

    def end(*args: Any) -> None:
        fired.append("end")

    torch._dynamo.reset()
    callback_handler.register_start_callback(start)
    callback_handler.register_end_callback(end)
    try:
        torch.compile(lambda x: x.tan() - 1, fullgraph=True)(torch.randn(4))
    finally:
        torch._dynamo.reset()
    if fired[:1] != ["start"] or "end" not in fired:
        raise ContractBroken(f"compile callbacks fired as {fired}")
    if start in callback_handler.start_callbacks:
        raise ContractBroken("torch._dynamo.reset() keeps compile callbacks now: install() need not renew them")


def break_compile_callbacks() -> contextlib.AbstractContextManager[Any]:
    from torch._dynamo.callback import CompilationCallbackHandler

    return mock.patch.object(CompilationCallbackHandler, "run_start_callbacks", lambda *a, **k: None)


def check_group_timeout_is_reachable() -> None:
    """A process group's backend keeps its timeout in ``options._timeout``, which
    dist.set_timeout (torch 2.14) or c10d._set_pg_timeout changes: the benchmark bounds
    the group's collectives by the knob with them."""
    from torch._inductor.runtime.collective_benchmarking import _group_timeout, _set_group_timeout

    with one_rank_group() as group:
        saved = _group_timeout(group)
        if saved != timedelta(seconds=60):
            raise ContractBroken(f"the group's timeout reads {saved}, not the 60 s it was made with")
        _set_group_timeout(timedelta(seconds=7), group)
        try:
            if _group_timeout(group) != timedelta(seconds=7):
                raise ContractBroken("setting the group's timeout did not change it")
        finally:
            _set_group_timeout(saved, group)


def break_group_timeout() -> contextlib.AbstractContextManager[Any]:
    import torch.distributed as dist

    return mock.patch.object(dist.ProcessGroup, "_get_backend", lambda self, device: object())


def check_group_registry() -> None:
    """c10d resolves a group by name (_resolve_process_group) and lists this rank's
    groups with their ranks (_world.pg_group_ranks): sessions and heartbeats use both."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with one_rank_group() as group:
        if torch._C._distributed_c10d._resolve_process_group(group.group_name) != group:
            raise ContractBroken("_resolve_process_group no longer returns the group by its name")
        if c10d._world.pg_group_ranks.get(group) != {0: 0}:
            raise ContractBroken(f"_world.pg_group_ranks reads {c10d._world.pg_group_ranks.get(group)}")
        if not isinstance(dist.distributed_c10d._get_default_store(), dist.Store):
            raise ContractBroken("_get_default_store no longer returns the job's Store")


def break_group_registry() -> contextlib.AbstractContextManager[Any]:
    from torch.distributed import distributed_c10d as c10d

    return mock.patch.object(type(c10d._world), "pg_group_ranks", property(lambda self: {}))


def check_store_primitives() -> None:
    """TCPStore tells its address (host, port, libuvBackend); a PrefixStore its
    underlying store; append, add, compare_set and check behave as the protocol needs;
    a wait that runs out raises DistStoreError, not DistNetworkError (a lost Store)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if not (isinstance(server.host, str) and server.port > 0 and isinstance(server.libuvBackend, bool)):
        raise ContractBroken("TCPStore no longer tells host, port and libuvBackend")
    prefixed = dist.PrefixStore("p", server)
    if prefixed.underlying_store is not server and not isinstance(prefixed.underlying_store, dist.TCPStore):
        raise ContractBroken("PrefixStore.underlying_store no longer gives the store below")
    prefixed.append("votes", "a\n")
    prefixed.append("votes", "b\n")
    if prefixed.get("votes") != b"a\nb\n" or prefixed.add("count", 1) != 1:
        raise ContractBroken("append or add no longer behave as the votes need")
    if prefixed.compare_set("decision", "", "x") != b"x" or prefixed.compare_set("decision", "", "y") != b"x":
        raise ContractBroken("compare_set no longer keeps the first value")
    try:
        prefixed.wait(["never"], timedelta(milliseconds=50))
    except dist.DistNetworkError as e:
        raise ContractBroken(f"a wait that runs out raises {type(e).__name__}") from e
    except dist.DistStoreError:
        return
    raise ContractBroken("a wait that runs out no longer raises")


def break_store_waits() -> contextlib.AbstractContextManager[Any]:
    import torch.distributed as dist

    return mock.patch.object(dist, "DistStoreError", type("Other", (Exception,), {}))


def check_python_kernel_of_custom_ops() -> None:
    """A torch.library.custom_op keeps its Python function (OPDEFS[name]._init_fn): the
    code identity of the op's own implementation digests it."""
    from torch._inductor.kernel.collective.choices import _python_kernel

    @torch.library.custom_op("collective_contract::kernel", mutates_args=())
    def kernel(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    if _python_kernel("collective_contract::kernel") is not kernel._init_fn:
        raise ContractBroken("the Python function of a custom op is no longer found")


def check_one_pointwise_config_without_autotuning() -> None:
    """With config.triton.autotune_pointwise off, a 1-D pointwise kernel has one
    launch config (nothing to time at its first launch); with it on, several."""
    from torch._inductor import config
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    def configs(autotune: bool) -> list[int]:
        seen: list[int] = []
        original = CachingAutotuner.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            seen.append(len(self.configs))

        # In this process (no compile workers), where the kernel's configs are made.
        patches = {"compile_threads": 1, "triton.autotune_pointwise": autotune}
        with fresh_inductor(), config.patch(patches), mock.patch.object(CachingAutotuner, "__init__", init):
            torch.compile(lambda x: x.neg() + 1, backend="inductor")(torch.randn(1 << 16, device="cuda"))
        return seen

    tuned, untuned = configs(True), configs(False)
    if not tuned or max(tuned) < 2:
        raise ContractBroken(f"a 1-D pointwise kernel no longer has several configs to tune: {tuned}")
    if untuned != [1] * len(untuned) or not untuned:
        raise ContractBroken(f"autotune_pointwise=False no longer leaves one config: {untuned}")


def break_autotune_pointwise() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.runtime import triton_heuristics

    original = triton_heuristics.pointwise

    def pointwise(*args: Any, inductor_meta: Any = None, **kwargs: Any) -> Any:
        return original(*args, inductor_meta={**(inductor_meta or {}), "autotune_pointwise": True}, **kwargs)

    return mock.patch.object(triton_heuristics, "pointwise", pointwise)


# -- the contracts ---------------------------------------------------------------------------


# -- range graphs: guards set while lowering choose the graph ------------------------------------


@functools.cache
def _range_probe() -> Any:
    """A custom op whose lowering guards its input's first size on ``<= 16`` (as
    collective/range_graphs.py guards a range) and returns the input times 1 or 2 by the
    branch it took, with what Inductor knew of the size afterwards."""
    import sympy
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    @torch.library.custom_op("collective_contract::range_probe", mutates_args=())
    def range_probe(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @range_probe.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    seen: list[bool] = []

    @lowering.register_lowering(torch.ops.collective_contract.range_probe.default)
    def _lower(x: Any) -> Any:
        size = x.get_size()[0]
        small = V.graph.sizevars.evaluate_expr(sympy.Le(size, 16))
        known = V.graph.sizevars.statically_known_leq(size, 16) if small else (
            V.graph.sizevars.statically_known_gt(size, 16))
        seen.append(known)
        return lowering.mul(x, 1 if small else 2)

    return range_probe, seen


def check_lowering_guards_choose_the_graph() -> None:
    """A shape guard added through V.graph.sizevars.evaluate_expr while lowering is
    known to Inductor for the rest of the compile and becomes a guard of the Dynamo
    frame: a size on the other side compiles again, one on the same side does not."""
    from torch._dynamo.testing import CompileCounterWithBackend

    probe, seen = _range_probe()
    counter = CompileCounterWithBackend("inductor")
    with fresh_inductor():
        compiled = torch.compile(lambda x: probe(x.relu()) + 0, backend=counter, dynamic=True)
        tags = []
        for n in (8, 12, 40, 64, 3):
            x = torch.rand(n, 4) + 0.5
            tags.append(int(round((compiled(x) / x).max().item())))
    if tags != [1, 1, 2, 2, 1]:
        raise ContractBroken(f"sizes 8, 12, 40, 64, 3 ran the branches {tags}, not [1, 1, 2, 2, 1]")
    if counter.frame_count != 2:
        raise ContractBroken(f"{counter.frame_count} compiles for two ranges: guards set while lowering "
                             "no longer choose the graph")
    if seen[-2:] != [True, True]:
        raise ContractBroken("Inductor does not know the guarded range for the rest of the compile")


def break_lowering_guards() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.sizevars import SizeVarAllocator

    # A size variable evaluated by its hint without a guard.
    return mock.patch.object(
        SizeVarAllocator, "evaluate_expr", lambda self, expr, *a, **k: bool(expr.subs(self.shape_env.var_to_val))
    )


CONTRACTS: list[Contract] = [
    # What the overlay's edits do.
    Contract("Scheduler.should_partition keeps a size dispatch inside CUDA-graph partitions",
             "dispatch.lower_size_dispatch", check_size_predicate_keeps_partitions,
             break_partitioner, needs_overlay=True),
    Contract("the torch.cond lowering keeps CUDA graphs for a predicate over sizes",
             "dispatch.lower_size_dispatch", check_size_predicate_keeps_cudagraphs,
             break_cond_lowering, needs_overlay=True),
    Contract("FxGraphCache.cache_hit_post_compile asks the collective gate about every hit",
             "graph_sessions.cached_graph_may_load", check_cache_hits_pass_the_gate,
             break_cache_hits, needs_overlay=True),
    Contract("CompiledFxGraph records the collective decisions its graph inlines",
             "graph_sessions.inlined_decisions", check_compiled_graphs_record_decisions,
             break_compiled_graphs, needs_overlay=True),
    Contract("custom-op registration and selection reach collective autotuning's hooks",
             "hooks", check_collectives_reach_the_selector, break_selector,
             needs_overlay=True),
    # The diff's selector returns no node for a winner with a graph: custom_op inlines it.
    Contract("custom_op inlines a winner's graph rather than the selector's node",
             "patches (select_algorithm.py)", check_winners_with_a_graph_are_inlined,
             replaced("torch._inductor.codegen.subgraph.inline_subgraph_to_ir_nodes",
                      lambda gm, inputs, name: None),
             needs_overlay=True),
    Contract("ShapeEnv.error_on_new_guards refuses guards (backported to 2.11)",
             "choice_modules.compiled_module", check_guards_are_refused,
             replaced("torch.fx.experimental.symbolic_shapes.ShapeEnv._check_frozen", lambda *a: None)),
    # Upstream internals used as they are.
    Contract("Dynamo runs registered compile callbacks", "collective/dynamo_callbacks.py",
             check_compile_callbacks_fire, break_compile_callbacks),
    Contract("a process group's timeout can be read and set", "collective_benchmarking",
             check_group_timeout_is_reachable, break_group_timeout),
    Contract("c10d resolves groups by name and lists a rank's groups", "collective_protocol",
             check_group_registry, break_group_registry),
    Contract("Store primitives behave as the protocol needs", "collective_protocol",
             check_store_primitives, break_store_waits),
    Contract("custom ops keep their Python function", "choices.code_identity",
             check_python_kernel_of_custom_ops, without("torch._library.custom_ops.OPDEFS")),
    Contract("SubgraphChoiceCaller compiles or only lowers a choice for benchmarking",
             "collective/choice_modules.py",
             has("torch._inductor.codegen.subgraph.SubgraphChoiceCaller._compile_for_benchmarking",
                 "lower_only"),
             without("torch._inductor.codegen.subgraph.SubgraphChoiceCaller._compile_for_benchmarking"),
             needs_overlay=True),
    Contract("inline_subgraph_to_ir_nodes(gm, inputs, name) inlines a traced graph",
             "collective/dispatch.py",
             has("torch._inductor.codegen.subgraph.inline_subgraph_to_ir_nodes", "gm", "inputs", "name"),
             without("torch._inductor.codegen.subgraph.inline_subgraph_to_ir_nodes")),
    Contract("_merge_config_and_runtime_kwargs(config_params, runtime_kwargs)", "collective/dispatch.py",
             has("torch._inductor.kernel.custom_op._merge_config_and_runtime_kwargs",
                 "config_params", "runtime_kwargs"),
             without("torch._inductor.kernel.custom_op._merge_config_and_runtime_kwargs")),
    Contract("the range-based lowering's signature, which the diff calls",
             "patches (custom_op.py)",
             has("torch._inductor.kernel.custom_op._range_based_lowering_fn", "processed_configs",
                 "default_impl", "name", "op_overload", "input_gen_fns", "tensor_name", "dim_index",
                 "ranges", "tensor_inputs", "runtime_kwargs", "range_upper_bound"),
             without("torch._inductor.kernel.custom_op._range_based_lowering_fn")),
    Contract("RangeImplGroup gives impl_func, impl_kwargs, impl_name and ranges", "collective/dispatch.py",
             has("torch._inductor.kernel.custom_op.RangeImplGroup.impl_func"),
             without("torch._inductor.kernel.custom_op.RangeImplGroup.impl_func")),
    Contract("CustomOpConfig keeps decomposition and params", "choices.register",
             lambda: _config_fields(), without("torch._inductor.kernel.custom_op.CustomOpConfig.__init__")),
    Contract("ExternKernelChoice(kernel, name=, has_out_variant=, op_overload=, use_fallback_kernel=)",
             "choices.complete_default_choice",
             has("torch._inductor.select_algorithm.ExternKernelChoice", "kernel", "name", "has_out_variant",
                 "op_overload", "use_fallback_kernel"),
             without("torch._inductor.select_algorithm.ExternKernelChoice")),
    Contract("ir_node_to_tensor and gm_original_output_strides", "collective/choice_modules.py",
             lambda: [has(f"torch._inductor.ir.{n}")() for n in ("ir_node_to_tensor", "gm_original_output_strides")],
             without("torch._inductor.ir.gm_original_output_strides")),
    Contract("IR classes the neighbours and the dispatch recognise", "collective/choice_modules.py",
             lambda: [has(f"torch._inductor.ir.{n}")() for n in
                      ("TensorBox", "StorageBox", "ComputedBuffer", "Pointwise", "ShapeAsConstantBuffer")],
             without("torch._inductor.ir.Pointwise")),
    Contract("fallback_handler(op, add_to_fallback_set=)", "dispatch.lowered_once",
             has("torch._inductor.lowering.fallback_handler", "add_to_fallback_set"),
             without("torch._inductor.lowering.fallback_handler")),
    Contract("config.triton.autotune_pointwise=False leaves a pointwise kernel one config",
             "timing.build", check_one_pointwise_config_without_autotuning,
             break_autotune_pointwise, needs_cuda=True),
    Contract("no_python_dispatcher", "collective/selection.py",
             has("torch._dispatch.python.no_python_dispatcher"),
             without("torch._dispatch.python.no_python_dispatcher")),
    Contract("write_atomic(path, content, make_dirs=)", "collective_decisions",
             has("torch._inductor.codecache.write_atomic", "make_dirs"),
             without("torch._inductor.codecache.write_atomic")),
    Contract("cache_dir()", "collective_decisions", has("torch._inductor.runtime.cache_dir_utils.cache_dir"),
             without("torch._inductor.runtime.cache_dir_utils.cache_dir")),
    Contract("clear_on_fresh_cache registers what fresh_cache clears", "collective/records.py",
             has("torch._inductor.utils.clear_on_fresh_cache"), without("torch._inductor.utils.clear_on_fresh_cache")),
    Contract("dynamo_timed(key, log_pt2_compile_event=, dynamo_compile_column_us=)", "hooks",
             has("torch._dynamo.utils.dynamo_timed", "key", "log_pt2_compile_event", "dynamo_compile_column_us"),
             without("torch._dynamo.utils.dynamo_timed")),
    Contract("trace_structured(name, metadata_fn=, payload_fn=)", "hooks",
             has("torch._logging.trace_structured", "name", "metadata_fn", "payload_fn"),
             without("torch._logging.trace_structured")),
    Contract("make_fx(fn, decomposition_table=, tracing_mode=) and select_decomp_table",
             "collective/choice_modules.py",
             lambda: [has("torch.fx.experimental.proxy_tensor.make_fx", "f", "decomposition_table",
                          "tracing_mode")(), has("torch._inductor.decomposition.select_decomp_table")()],
             without("torch._inductor.decomposition.select_decomp_table")),
    Contract("dont_skip_tracing", "collective/dispatch.py", has("torch._dynamo.dont_skip_tracing"),
             without("torch._dynamo.dont_skip_tracing")),
    Contract("guards set through V.graph.sizevars while lowering choose the Dynamo frame's graph",
             "collective/range_graphs.py", check_lowering_guards_choose_the_graph, break_lowering_guards),
    Contract("what tells range graphs where a range cannot be guarded", "collective/range_graphs.py",
             lambda: [has(p)() for p in (
                 "torch._inductor.sizevars.SizeVarAllocator.statically_known_leq",
                 "torch._inductor.sizevars.SizeVarAllocator.statically_known_gt",
                 "torch._dynamo.config.recompile_limit", "torch._dynamo.config.error_on_recompile",
                 "torch._dynamo.eval_frame._stance.stance", "torch._guards.TracingContext.try_get",
                 "torch.compiler.is_exporting",
                 "torch.fx.experimental.symbolic_shapes.free_unbacked_symbols")]
             + [has("torch._inductor.graph.GraphLowering.__init__", "is_backward")()],
             without("torch._dynamo.config.error_on_recompile")),
    Contract("torch.compiler.is_dynamo_compiling (no dispatch mode while Dynamo traces)",
             "waits.with_waits", has("torch.compiler.is_dynamo_compiling"),
             without("torch.compiler.is_dynamo_compiling")),
    Contract("the functorch bundled_autograd_cache knob", "hooks.note_registration",
             has("torch._functorch.config.bundled_autograd_cache"),
             without("torch._functorch.config.bundled_autograd_cache")),
    Contract("torch.cuda._sleep (GPU sleeps before a graph round)", "collective_benchmarking",
             has("torch.cuda._sleep"), without("torch.cuda._sleep"), needs_cuda=True),
    Contract("symmetric memory's empty, rendezvous (and enable_symm_mem_for_group where present)",
             "timing._move_to_symmetric_memory",
             lambda: [has(f"torch.distributed._symmetric_memory.{n}")() for n in ("empty", "rendezvous")],
             without("torch.distributed._symmetric_memory.rendezvous"), needs_cuda=True),
]


def _config_fields() -> None:
    from torch._inductor.kernel.custom_op import CustomOpConfig

    config = CustomOpConfig(lambda x: x, scale=2)
    if not (callable(config.decomposition) and config.params == {"scale": 2}):
        raise ContractBroken("CustomOpConfig no longer keeps .decomposition and .params")


def not_checkable(contract: Contract) -> str:
    """Why ``contract`` cannot be checked here, or ""."""
    if contract.needs_overlay and not overlay_applied():
        return "the overlay is not applied to this torch"
    if contract.needs_cuda and not torch.cuda.is_available():
        return "needs CUDA"
    return ""


def main() -> int:
    failed = 0
    print(f"torch {torch.__version__}: {len(CONTRACTS)} contracts")
    for contract in CONTRACTS:
        why_not = not_checkable(contract)
        if why_not:
            print(f"  not checked  {contract.name} ({why_not})")
            continue
        try:
            contract.verify()
        except ContractBroken as e:
            failed += 1
            print(f"  FAILED       {contract.name} (relied on by {contract.used_by}): {e}")
        else:
            print(f"  ok           {contract.name}")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="collective_contracts_"))
    sys.exit(main())
