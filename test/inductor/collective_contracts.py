"""Every upstream assumption of collective autotuning, stated once and checked.

Each :class:`Contract` names one internal of torch that the patch relies on (a name it
imports, a signature it calls, a class it recognises, or what one of the overlay's
edits does), which of our modules relies on it, how to check it, and how upstream
could break it (``breaks``: the same internal as a change upstream would leave it).
When torch moves, a contract fails and says which assumption; nothing of ours goes
silently dead.

A check calls what it names on a tiny input and looks at what it does (where no tiny
input can be made, as for the range-based lowering the diff calls, it checks the
signature). A break keeps the name and changes its behaviour as upstream could (a
renamed or keyword-only argument, another return, a hook no longer called, a field
with a new meaning): a removal would show only that a check looks the name up.

* ``test_collective_op_tuning_contracts.py`` runs every contract as a test, and shows
  that each one fails once its assumption is broken.
* ``python test/inductor/collective_contracts.py`` prints one line per contract and
  exits 1 if any fails: ``tools/overlay.py check`` runs it with the torch being
  checked. Contracts about what the overlay's edits do need the overlay applied;
  without it they are reported as not checked.

Effects are checked on CPU, in one process, on real lowered graphs (a process group of
one rank where one is needed); contracts about CUDA-only internals run where CUDA is.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
import math
import os
import shutil
import sys
import tempfile
import time
import types
from datetime import timedelta
from typing import Any
from collections.abc import Callable, Iterator
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
        except Exception as e:
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
                raise ContractBroken(
                    f"{path} no longer takes {missing}; it takes {list(accepted)}"
                )

    return check


def replaced(
    path: str, value: Any
) -> Callable[[], contextlib.AbstractContextManager[Any]]:
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
            "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timedelta(seconds=60),
        )
    try:
        yield dist.group.WORLD
    finally:
        if created:
            dist.destroy_process_group()


@contextlib.contextmanager
def fresh_inductor() -> Iterator[None]:
    """Compiles from scratch, in a cache dir of their own, which keeps their collective
    decisions too (fresh_cache does not move collective_autotune_decisions_dir)."""
    from torch._inductor import config
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with fresh_cache():
        decisions = os.path.join(cache_dir(), "collective_autotuning", "decisions")
        with config.patch(collective_autotune_decisions_dir=decisions):
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
        with (
            fresh_inductor(),
            scheduled_graphs() as seen,
            config.patch({"triton.cudagraphs": True, "graph_partition": True}),
            mock.patch("torch._inductor.lowering.is_triton", lambda x: True),
        ):
            x = torch.randn(6, 3)
            torch._dynamo.mark_dynamic(x, 0)
            torch.compile(fn, fullgraph=True)(x)
        for scheduler, reason in seen:
            nodes = [
                n
                for n in scheduler.nodes
                if isinstance(getattr(n, "node", None), _switch_class())
            ]
            if nodes:
                found[name] = (scheduler, nodes[0], reason)
    if set(found) != {"size", "data"}:
        raise ContractBroken(
            f"no Switch/Conditional node was scheduled for the conds: {sorted(found)}"
        )
    return found


# -- the effects of the overlay's edits ---------------------------------------------------------


def check_size_predicate_keeps_partitions() -> None:
    """Scheduler.should_partition keeps a cond whose predicate reads sizes only inside a
    CUDA-graph partition (the size dispatch), and still partitions at a data predicate."""
    from torch._inductor import config
    from torch._inductor.scheduler import Scheduler

    for name, (scheduler, node, _) in _lowered_conds().items():
        with (
            config.patch({"triton.cudagraphs": True, "graph_partition": True}),
            mock.patch.object(node, "is_gpu", lambda: True),
        ):
            verdict = Scheduler.should_partition(scheduler, node)
        if name == "size" and verdict is not None:
            raise ContractBroken(
                f"a size dispatch is partitioned out of CUDA graphs: {verdict!r}"
            )
        if name == "data" and verdict is None:
            raise ContractBroken(
                "a cond over device data is no longer partitioned: the rule changed"
            )


def check_size_predicate_keeps_cudagraphs() -> None:
    """The cond lowering keeps CUDA graphs on for a predicate over sizes only, and turns
    them off for one over device data."""
    conds = _lowered_conds()
    if conds["size"][2] is not None:
        raise ContractBroken(
            f"a size dispatch turns CUDA graphs off: {conds['size'][2]!r}"
        )
    if conds["data"][2] is None:
        raise ContractBroken(
            "a cond over device data no longer turns CUDA graphs off: the rule changed"
        )


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


def _compile_twice(**patches: Any) -> None:
    """Compile one graph twice on fresh caches, the FX-graph cache on: a miss, then a
    lookup that finds the first's entry."""
    from torch._inductor import config

    with fresh_inductor(), config.patch(fx_graph_cache=True, **patches):
        for _ in range(2):
            torch._dynamo.reset()
            torch.compile(lambda x: x.sin() + 1, fullgraph=True)(torch.randn(4))


def check_cache_lookup_passes_over_unusable_entries() -> None:
    """FxGraphCache's lookup asks cached_graph_usable (through GuardedCache._usable)
    of every candidate entry of a key, and passes over one it refuses: a miss."""
    from torch._dynamo.utils import counters
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.output_code import CompiledFxGraph

    asked: list[Any] = []

    def usable(graph: Any) -> bool:
        asked.append(graph)
        return False

    counters.clear()
    with mock.patch.object(hooks, "cached_graph_usable", usable):
        _compile_twice()
    if not asked or not isinstance(asked[0], CompiledFxGraph):
        raise ContractBroken(f"the lookup did not ask about its entry (asked: {asked})")
    if counters["inductor"]["fxgraph_cache_hit"]:
        raise ContractBroken("an entry the collective check refused was a hit")


def break_cache_lookup() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.codecache import FxGraphCache

    # A lookup that no longer consults _usable (as upstream's without the overlay).
    return mock.patch.object(
        FxGraphCache, "_usable", classmethod(lambda cls, candidate: True)
    )


def check_cache_hits_ask_the_group() -> None:
    """FxGraphCache.load_with_key asks group_takes_cached_graph of a hit before it
    counts and returns it; a hit the group does not take is a miss, and compiled."""
    from torch._dynamo.utils import counters
    from torch._inductor import compile_fx
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.output_code import CompiledFxGraph

    asked: list[Any] = []
    compiled: list[Any] = []
    codegen = compile_fx.fx_codegen_and_compile

    def group_takes(graph: Any, key: str) -> bool:
        asked.append(graph)
        return False

    def spy(*args: Any, **kwargs: Any) -> Any:
        compiled.append(args)
        return codegen(*args, **kwargs)

    counters.clear()
    with (
        mock.patch.object(hooks, "group_takes_cached_graph", group_takes),
        mock.patch.object(compile_fx, "fx_codegen_and_compile", spy),
    ):
        _compile_twice()
    if not asked or not isinstance(asked[0], CompiledFxGraph):
        raise ContractBroken(f"a hit did not ask the group (asked: {asked})")
    if len(compiled) != 2 or counters["inductor"]["fxgraph_cache_hit"]:
        raise ContractBroken(
            f"a hit the group refused was not a compiled miss ({len(compiled)} "
            f"compiles, {counters['inductor']['fxgraph_cache_hit']} hits)"
        )


def break_cache_hits() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.codecache import FxGraphCache

    # Upstream's load_with_key no longer finds its hits in _lookup_graph (the call the
    # overlay follows with the group's check): every lookup there is a miss.
    return mock.patch.object(
        FxGraphCache,
        "_lookup_graph",
        staticmethod(lambda *args, **kwargs: (None, {})),
    )


def _compile_twice_bundled() -> None:
    """_compile_twice with AOTAutograd's cache bundling its compiled graphs."""
    from torch._functorch import config as functorch_config

    with functorch_config.patch(
        enable_autograd_cache=True, bundled_autograd_cache=True
    ):
        _compile_twice()


def _expect_the_groups_error(e: Exception) -> None:
    """``e`` is the group's CollectiveAutotuneError, or wraps it (Dynamo wraps what the
    backend raised); anything else means upstream swallowed or replaced it."""
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError

    if not isinstance(e, CollectiveAutotuneError) and not isinstance(
        e.__cause__ or e.__context__, CollectiveAutotuneError
    ):
        raise ContractBroken(f"the group's error became {e!r}") from e


def check_bundled_cache_entries_are_asked_about() -> None:
    """AOTAutogradCache's lookup asks cached_entry_usable of every candidate entry
    (GuardedCache._usable); try_load asks group_takes_cached_entry of a hit before it
    uses it, a refused one being a miss that is compiled; and a
    CollectiveAutotuneError raised there reaches the caller, not a bypass."""
    from torch._dynamo.utils import counters
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError

    asked: dict[str, list[Any]] = {"usable": [], "group": []}

    def usable(entry: Any) -> bool:
        asked["usable"].append(entry)
        return True

    def group_takes(entry: Any, key: str) -> bool:
        asked["group"].append(entry)
        return False

    counters.clear()
    with (
        mock.patch.object(hooks, "cached_entry_usable", usable),
        mock.patch.object(hooks, "group_takes_cached_entry", group_takes),
    ):
        _compile_twice_bundled()
    if not asked["usable"] or not asked["group"]:
        raise ContractBroken(f"a bundled entry was not asked about: {asked}")
    if counters["aot_autograd"]["autograd_cache_hit"]:
        raise ContractBroken("a bundled hit the group refused was used")

    def fails(entry: Any, key: str) -> bool:
        raise CollectiveAutotuneError("the group is gone")

    with mock.patch.object(hooks, "group_takes_cached_entry", fails):
        try:
            _compile_twice_bundled()
        except Exception as e:
            _expect_the_groups_error(e)
        else:
            raise ContractBroken("the group's error inside try_load was swallowed")


def break_bundled_cache_entries() -> contextlib.AbstractContextManager[Any]:
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache

    return mock.patch.object(
        AOTAutogradCache, "_usable", classmethod(lambda cls, candidate: True)
    )


def _standalone_twice(**refusals: Callable[..., bool]) -> Any:
    """standalone_compile one graph on fresh caches (AOTAutograd's and the FX-graph
    cache on, unbundled as vLLM's standalone path has them), then again with the
    collective ``refusals`` patched into hooks: the second compile's artifact."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.kernel.collective import hooks

    gm = torch.fx.symbolic_trace(lambda x: torch.sin(x) + 1)

    def compile_once() -> Any:
        return torch._inductor.standalone_compile(
            gm, [torch.randn(4)], dynamic_shapes="from_example_inputs", options={}
        )

    with (
        fresh_inductor(),
        config.patch(fx_graph_cache=True),
        functorch_config.patch(
            enable_autograd_cache=True, bundled_autograd_cache=False
        ),
    ):
        compile_once()
        with contextlib.ExitStack() as stack:
            for name, refusal in refusals.items():
                stack.enter_context(mock.patch.object(hooks, name, refusal))
            return compile_once()


def check_refused_hits_leave_one_artifact() -> None:
    """A cache lookup records the entry it finds (CacheArtifactManager's
    _new_cache_artifacts and _seen_artifacts, by type and key) before the group's check
    or the FX graphs' load: a hit refused there (group_takes_cached_entry /
    group_takes_cached_graph) or whose FX graph the gate passes over
    (cached_graph_usable) is taken out, so standalone_compile's artifact holds exactly
    one AOTAutograd entry, as vLLM's InductorStandaloneAdaptor requires."""
    from torch._inductor.kernel.collective import graph_sessions

    def refuses(decisions: Any) -> bool:
        return False

    with mock.patch.object(graph_sessions, "group_takes_cached_graph", refuses):
        refused = _standalone_twice()
    passed_over = _standalone_twice(cached_graph_usable=lambda graph: False)
    for what, artifact in (("refused", refused), ("passed over", passed_over)):
        if not artifact.is_saveable():
            raise ContractBroken(
                f"a cache hit {what} left an unsaveable artifact: "
                f"{artifact._artifacts and artifact._artifacts[1]}"
            )


def break_recorded_artifacts() -> contextlib.AbstractContextManager[Any]:
    from torch.compiler._cache import CacheArtifactManager

    record = CacheArtifactManager.record_artifact.__func__

    def record_numbered(cls: Any, artifact_type: str, key: str, content: Any) -> None:
        # Upstream recording each entry under a name of its own, not its cache key.
        number = len(cls._new_cache_artifacts.get(artifact_type, []))
        record(cls, artifact_type, f"{key}/{number}", content)

    return mock.patch.object(
        CacheArtifactManager, "record_artifact", classmethod(record_numbered)
    )


def check_graph_loads_let_the_groups_errors_out() -> None:
    """A CollectiveAutotuneError that the group's check of a cached FX graph
    (group_takes_cached_graph) raises while AOTAutogradCache loads a hit, its entry's
    graphs loaded from the FX-graph cache, reaches the caller: AOTAutogradCache.try_load
    turns any other error of that load into a bypass, on this rank alone."""
    from torch._functorch import config as functorch_config
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError

    raised: list[Any] = []

    def fails_once(graph: Any, *key: Any) -> bool:
        # Only the load inside try_load: after a bypass, the compile's own lookup of
        # the graph is taken, and the compile succeeds.
        if raised:
            return True
        raised.append(graph)
        raise CollectiveAutotuneError("the group is gone")

    with (
        functorch_config.patch(
            enable_autograd_cache=True, bundled_autograd_cache=False
        ),
        mock.patch.object(hooks, "group_takes_cached_graph", fails_once),
    ):
        try:
            _compile_twice()
        except Exception as e:
            _expect_the_groups_error(e)
        else:
            if not raised:
                raise ContractBroken(
                    "loading an AOTAutograd hit asked no graph's group"
                )
            raise ContractBroken(
                "the group's error while loading a hit's graph became a bypass"
            )


def break_graph_loads_let_the_groups_errors_out() -> contextlib.AbstractContextManager[
    Any
]:
    from torch._inductor.kernel.collective import hooks

    # try_load without the hunk that lets the group's error out: the error it catches
    # as the group's is another class than the one raised.
    class OtherError(Exception):
        pass

    return mock.patch.object(hooks, "CollectiveAutotuneError", OtherError)


def check_compiled_graphs_record_decisions() -> None:
    """CompiledFxGraph has a collective_decisions field, filled from the graph lowered."""
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.output_code import CompiledFxGraph

    if "collective_decisions" not in {
        f.name for f in dataclasses.fields(CompiledFxGraph)
    }:
        raise ContractBroken("CompiledFxGraph has no collective_decisions field")
    graphs: list[Any] = []
    original = hooks.inlined_decisions

    def spy(graph: Any) -> Any:
        graphs.append(graph)
        return original(graph)

    with fresh_inductor(), mock.patch.object(hooks, "inlined_decisions", spy):
        torch.compile(lambda x: x.cos() * 2, fullgraph=True)(torch.randn(4))
    if not graphs:
        raise ContractBroken(
            "a compiled graph no longer records its collective decisions"
        )


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
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    custom_op = _contract_all_reduce()
    op = torch.ops.collective_contract.all_reduce.default
    noted: list[Any] = []
    selected: list[Any] = []
    note, select = hooks.note_registration, hooks.select_collective_choice
    with mock.patch.object(
        hooks, "note_registration", lambda *a: noted.append(a) or note(*a)
    ):
        # torch 2.11 takes the decorated function only; later torch its OpOverload too.
        register_custom_op_autotuning(
            custom_op, configs=[CustomOpConfig(one_all_reduce)]
        )
    with (
        one_rank_group() as group,
        fresh_inductor(),
        mock.patch.object(
            hooks,
            "select_collective_choice",
            lambda *a, **k: selected.append(a) or select(*a, **k),
        ),
    ):
        torch.compile(lambda x: op(x, group.group_name) + 1, fullgraph=True)(
            torch.randn(4, 4)
        )
    if not noted:
        raise ContractBroken(
            "register_custom_op_autotuning no longer calls note_registration"
        )
    if not selected:
        raise ContractBroken(
            "a collective op's selection no longer reaches select_collective_choice"
        )


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
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    custom_op = _contract_slow_all_reduce()
    op = torch.ops.collective_contract.slow_all_reduce.default
    register_custom_op_autotuning(custom_op, configs=[CustomOpConfig(one_all_reduce)])
    inlined: list[Any] = []
    inline = subgraph.inline_subgraph_to_ir_nodes
    with (
        one_rank_group() as group,
        fresh_inductor(),
        mock.patch.object(
            subgraph,
            "inline_subgraph_to_ir_nodes",
            lambda *a, **k: inlined.append(a) or inline(*a, **k),
        ),
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
        raise ContractBroken(
            "the compiled graph calls the op's own implementation, not the winner"
        )
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
    def call(
        self: Any, name: str, choices: list[Any], *args: Any, **kwargs: Any
    ) -> Any:
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


def check_guards_lengthen_the_guard_list() -> None:
    """A guard a ShapeEnv adds lengthens ShapeEnv.guards: a collective op's choices are
    traced again after a new guard of the graph (choices.traced_once counts them)."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    size = env.create_symintnode(env.create_symbol(8, source=_source()), hint=8)
    guards = len(env.guards)
    bool(size > 4)
    if len(env.guards) <= guards:
        raise ContractBroken("a guard added did not lengthen ShapeEnv.guards")


def break_guard_list() -> contextlib.AbstractContextManager[Any]:
    """ShapeEnv keeping its guards elsewhere: its ``guards`` stays empty."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return mock.patch.object(
        ShapeEnv,
        "guards",
        property(lambda self: [], lambda self, value: None),
        create=True,
    )


def check_free_symbols_of_sizes() -> None:
    """symbolic_shapes.free_symbols finds the symbols of a fake tensor's sizes and of a
    list of IR sizes (sympy), and none in a fake tensor of static sizes: traced_once tells
    torch 2.11's choices traced at a range's static size from the site's symbolic ones."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import free_symbols, ShapeEnv

    env = ShapeEnv()
    size = env.create_symintnode(env.create_symbol(8, source=_source()), hint=8)
    with FakeTensorMode(shape_env=env):
        symbolic, static = torch.empty(size, 4), torch.empty(8, 4)
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    if not free_symbols([symbolic]) or not free_symbols([[s0, sympy.Integer(4)]]):
        raise ContractBroken("free_symbols found no symbol in symbolic sizes")
    if free_symbols([static]):
        raise ContractBroken("free_symbols found a symbol in static sizes")


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
        raise ContractBroken(
            "torch._dynamo.reset() keeps compile callbacks now: install() need not renew them"
        )


def break_compile_callbacks() -> contextlib.AbstractContextManager[Any]:
    from torch._dynamo.callback import CompilationCallbackHandler

    return mock.patch.object(
        CompilationCallbackHandler, "run_start_callbacks", lambda *a, **k: None
    )


def _unchecked_guards_seen(compile_model: Callable[[Callable], Any]) -> list[Any]:
    """What range_graphs.unchecked_guards says inside the backend of one compile."""
    from torch._inductor.kernel.collective.range_graphs import unchecked_guards

    seen: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        seen.append(unchecked_guards())
        # A backend's own tracing context (standalone_compile makes one).
        fake_mode = torch._guards.detect_fake_mode(example_inputs)
        with torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
            seen.append(unchecked_guards())
        return gm.forward

    torch._dynamo.reset()
    try:
        with contextlib.suppress(RuntimeError):  # aot_compile wants serializable code
            compile_model(backend)
    finally:
        torch._dynamo.reset()
    return seen


def check_backends_see_whether_guards_are_checked() -> None:
    """A backend sees the hooks of the frame Dynamo compiles (the frame's
    CompileContext.frame_hooks, patch 0010) and the frame's SHAPE_ENV guard in
    its tracing context; make_guard_filter_entry builds that guard's entry without a
    builder, and the guard filters keep or drop it; aot_compile's backend call and a
    backend's own tracing context have neither (range_graphs.unchecked_guards)."""
    x = torch.randn(8, 4)
    torch._dynamo.mark_dynamic(x, 0)

    def f(t: torch.Tensor) -> torch.Tensor:
        return t.sin() + 1

    def compiled(guard_filter_fn: Any = None) -> Callable[[Callable], Any]:
        options = {"guard_filter_fn": guard_filter_fn} if guard_filter_fn else {}
        return lambda backend: torch.compile(
            f, backend=backend, fullgraph=True, options=options
        )(x)

    plain, own_context = _unchecked_guards_seen(compiled())
    if plain is not None:
        raise ContractBroken(f"a plain torch.compile's guards read unchecked: {plain}")
    if own_context is None:
        raise ContractBroken(
            "a backend's own tracing context reads as Dynamo's frame's"
        )
    kept, _ = _unchecked_guards_seen(
        compiled(torch.compiler.keep_portable_guards_unsafe)
    )
    if kept is not None:
        raise ContractBroken(f"keep_portable_guards_unsafe reads as dropping: {kept}")
    dropped, _ = _unchecked_guards_seen(compiled(torch.compiler.skip_all_guards_unsafe))
    if dropped is None or "skip_all_guards_unsafe" not in dropped:
        raise ContractBroken(f"skip_all_guards_unsafe reads as keeping: {dropped}")
    with torch._dynamo.config.patch(enable_aot_compile=True):
        aot = _unchecked_guards_seen(
            lambda backend: torch.compile(
                f, backend=backend, fullgraph=True
            ).aot_compile(((x,), {}))
        )
    if not aot or aot[0] is None:
        raise ContractBroken(f"aot_compile's backend call reads as guarded: {aot}")


def break_frame_hooks() -> contextlib.AbstractContextManager[Any]:
    from torch._dynamo.hooks import Hooks
    from torch._guards import CompileContext

    # The frame's hooks no longer kept: every compile context reads default hooks.
    return mock.patch.object(
        CompileContext,
        "frame_hooks",
        property(lambda self: Hooks(), lambda self, value: None),
        create=True,
    )


def check_timing_groups_run_collectives_by_name() -> None:
    """A group built from a gloo backend over the Store (c10d's ProcessGroup,
    _register_backend, _set_default_backend, _set_group_name) and registered by name
    (_register_process_group, _unregister_process_group) runs the functional
    collectives that name it, and all-reduces on itself: the benchmark times on it."""
    from torch._inductor.runtime import collective_timing_group as timing

    fc = torch.ops._c10d_functional
    with one_rank_group() as group:
        if not timing.has_timing_group(group):
            raise ContractBroken("no timing group can be made of a gloo group")
        made = timing.timing_group(group, 5.0, 0)
        try:
            name = timing.timing_name(group.group_name)
            resolved = torch._C._distributed_c10d._resolve_process_group(name)
            if resolved.group_name != made.group_name:
                raise ContractBroken(f"{name} resolves to {resolved.group_name}")
            x = torch.arange(4.0)
            if not torch.equal(fc.wait_tensor(fc.all_reduce(x, "sum", name)), x):
                raise ContractBroken("a functional all-reduce by its name went wrong")
        finally:
            timing.discard(group, 5.0)


def break_timing_groups() -> contextlib.AbstractContextManager[Any]:
    import torch.distributed as dist

    return mock.patch.object(
        dist.ProcessGroup, "_get_backend", lambda self, device: object()
    )


def check_in_place_collectives_remap() -> None:
    """torch.distributed.all_reduce defers to a torch function mode, and torch maps it
    (traceable_collective_remaps, REDUCE_OP_TO_STR) to a functional collective: a
    choice written in place traces to one (collective/in_place.py)."""
    import torch.distributed as dist
    from torch._inductor.kernel.collective.in_place import AsFunctional
    from torch.fx.experimental.proxy_tensor import make_fx

    def in_place(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM)
        return y

    def traced(x: torch.Tensor) -> torch.Tensor:
        with AsFunctional():
            return in_place(x)

    with one_rank_group():
        gm = make_fx(traced)(torch.ones(4))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    if torch.ops._c10d_functional.all_reduce.default not in targets:
        raise ContractBroken(f"dist.all_reduce traced to {targets}")


def break_in_place_remaps() -> contextlib.AbstractContextManager[Any]:
    from torch.distributed import _functional_collectives as funcol

    return mock.patch.dict(funcol.traceable_collective_remaps, clear=True)


def check_process_groups_by_type() -> None:
    """c10d's own ops take a ProcessGroup by a script class type, the type of a boxed
    group: an op that takes one communicates (detection.takes_group_by_type)."""
    from torch._inductor.kernel.collective import detection

    expected = detection._process_group_type.__wrapped__()
    with one_rank_group() as group:
        if expected is None or group.boxed()._type() != expected:
            raise ContractBroken(
                f"c10d::barrier takes a group as {expected}, not as a boxed group"
            )


def break_process_groups_by_type() -> contextlib.AbstractContextManager[Any]:
    return mock.patch.object(
        torch.ops.c10d, "barrier", torch.ops._c10d_functional.all_reduce
    )


def check_group_registry() -> None:
    """c10d resolves a group by name (_resolve_process_group) and lists this rank's
    groups with their ranks (_world.pg_group_ranks): sessions and heartbeats use both."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with one_rank_group() as group:
        if torch._C._distributed_c10d._resolve_process_group(group.group_name) != group:
            raise ContractBroken(
                "_resolve_process_group no longer returns the group by its name"
            )
        if c10d._world.pg_group_ranks.get(group) != {0: 0}:
            raise ContractBroken(
                f"_world.pg_group_ranks reads {c10d._world.pg_group_ranks.get(group)}"
            )
        if not isinstance(dist.distributed_c10d._get_default_store(), dist.Store):
            raise ContractBroken("_get_default_store no longer returns the job's Store")


def break_group_registry() -> contextlib.AbstractContextManager[Any]:
    from torch.distributed import distributed_c10d as c10d

    return mock.patch.object(
        type(c10d._world), "pg_group_ranks", property(lambda self: {})
    )


def check_store_primitives() -> None:
    """TCPStore tells its address (host, port, libuvBackend); a PrefixStore its
    underlying store; append, add, compare_set and check behave as the protocol needs;
    a wait that runs out raises DistStoreError, not DistNetworkError (a lost Store)."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    if not (
        isinstance(server.host, str)
        and server.port > 0
        and isinstance(server.libuvBackend, bool)
    ):
        raise ContractBroken("TCPStore no longer tells host, port and libuvBackend")
    prefixed = dist.PrefixStore("p", server)
    if prefixed.underlying_store is not server and not isinstance(
        prefixed.underlying_store, dist.TCPStore
    ):
        raise ContractBroken(
            "PrefixStore.underlying_store no longer gives the store below"
        )
    prefixed.append("votes", "a\n")
    prefixed.append("votes", "b\n")
    if prefixed.get("votes") != b"a\nb\n" or prefixed.add("count", 1) != 1:
        raise ContractBroken("append or add no longer behave as the votes need")
    if (
        prefixed.compare_set("decision", "", "x") != b"x"
        or prefixed.compare_set("decision", "", "y") != b"x"
    ):
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

    class PrefixStore(dist.PrefixStore):
        # A wait that runs out reported as a network error (as a lost Store is).
        def wait(self, keys: list[str], *timeout: Any) -> None:
            try:
                super().wait(keys, *timeout)
            except dist.DistStoreError as e:
                raise dist.DistNetworkError(str(e)) from e

    return mock.patch.object(dist, "PrefixStore", PrefixStore)


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
        with (
            fresh_inductor(),
            config.patch(patches),
            mock.patch.object(CachingAutotuner, "__init__", init),
        ):
            torch.compile(lambda x: x.neg() + 1, backend="inductor")(
                torch.randn(1 << 16, device="cuda")
            )
        return seen

    tuned, untuned = configs(True), configs(False)
    if not tuned or max(tuned) < 2:
        raise ContractBroken(
            f"a 1-D pointwise kernel no longer has several configs to tune: {tuned}"
        )
    if untuned != [1] * len(untuned) or not untuned:
        raise ContractBroken(
            f"autotune_pointwise=False no longer leaves one config: {untuned}"
        )


def break_autotune_pointwise() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.runtime import triton_heuristics

    original = triton_heuristics.pointwise

    def pointwise(*args: Any, inductor_meta: Any = None, **kwargs: Any) -> Any:
        return original(
            *args,
            inductor_meta={**(inductor_meta or {}), "autotune_pointwise": True},
            **kwargs,
        )

    return mock.patch.object(triton_heuristics, "pointwise", pointwise)


# -- upstream internals, checked by what they do on a tiny input ----------------------


def check_python_kernel_of_custom_ops() -> None:
    """A torch.library.custom_op keeps the very function it was made from
    (OPDEFS[name]._init_fn): the code identity of the op's own implementation
    digests it."""
    from torch._inductor.kernel.collective.choices import _python_kernel

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    torch.library.custom_op("collective_contract::kernel", mutates_args=())(kernel)
    if _python_kernel("collective_contract::kernel") is not kernel:
        raise ContractBroken("the Python function of a custom op is no longer found")


def break_python_kernels() -> contextlib.AbstractContextManager[Any]:
    from torch._library.custom_ops import CustomOpDef

    original = CustomOpDef.__init__

    # A custom op keeps a wrapper of its function (one code for every op).
    def init(
        self: Any, namespace: str, name: str, schema: str, fn: Any, *a: Any, **k: Any
    ) -> None:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        original(self, namespace, name, schema, wrapper, *a, **k)

    return mock.patch.object(CustomOpDef, "__init__", init)


def check_config_fields() -> None:
    """CustomOpConfig(decomposition, **params) keeps .decomposition and .params."""
    from torch._inductor.kernel.custom_op import CustomOpConfig

    config = CustomOpConfig(lambda x: x, scale=2)
    if not (callable(config.decomposition) and config.params == {"scale": 2}):
        raise ContractBroken(
            "CustomOpConfig no longer keeps .decomposition and .params"
        )


def break_config_fields() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.kernel.custom_op import CustomOpConfig

    original = CustomOpConfig.__init__

    # .params kept as sorted items (hashable, for a cache key).
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.params = tuple(sorted(self.params.items()))

    return mock.patch.object(CustomOpConfig, "__init__", init)


_MERGE = "torch._inductor.kernel.custom_op._merge_config_and_runtime_kwargs"


def check_merged_kwargs() -> None:
    """_merge_config_and_runtime_kwargs(config_params, runtime_kwargs) gives the call's
    keyword arguments: both dicts in one (which wins a clash differs by minor)."""
    has(_MERGE, "config_params", "runtime_kwargs")()
    merged = resolve(_MERGE)({"chunks": 2}, {"group_name": "g"})
    if merged != {"chunks": 2, "group_name": "g"}:
        raise ContractBroken(
            f"merging {{'chunks': 2}} and {{'group_name': 'g'}} gave {merged}"
        )


def check_range_impl_groups() -> None:
    """RangeImplGroup(ImplConfig(impl_name, impl_func, kwargs)) gives them back as
    impl_name, impl_func and impl_kwargs, and its ranges (RangeBounds) in size order."""
    from torch._inductor.kernel.custom_op import ImplConfig, RangeBounds, RangeImplGroup

    def impl(x: torch.Tensor, chunks: int = 1) -> torch.Tensor:
        return x

    group = RangeImplGroup(
        ImplConfig(impl_name="chunked", impl_func=impl, kwargs={"chunks": 2})
    )
    group.add_range(RangeBounds(65, float("inf")))
    group.add_range(RangeBounds(1, 16))
    got = (group.impl_name, group.impl_func, group.impl_kwargs)
    if got != ("chunked", impl, {"chunks": 2}):
        raise ContractBroken(
            f"a RangeImplGroup gives (impl_name, impl_func, impl_kwargs) {got}"
        )
    if [(r.start, r.end) for r in group.ranges] != [(1, 16), (65, float("inf"))]:
        raise ContractBroken(f"a RangeImplGroup's ranges read {group.ranges}")


def break_range_impl_groups() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.kernel.custom_op import RangeImplGroup

    # The implementation comes with its kwargs bound; impl_kwargs is empty.
    def bound(group: Any) -> Any:
        return functools.partial(
            group.impl_config.impl_func, **group.impl_config.kwargs
        )

    return mock.patch.multiple(
        RangeImplGroup,
        impl_func=property(bound),
        impl_kwargs=property(lambda group: {}),
    )


_TWO_RANGES = [(1, 4), (5, math.inf)]


def _implementation(x: torch.Tensor) -> torch.Tensor:
    return x


# What autotune_custom_op returns for every range below: one winner.
_WINNER = types.SimpleNamespace(
    name="impl",
    decomposition=_implementation,
    decomposition_kwargs={},
    config_patches={},
)


def _lower_two_ranges(
    autotune: Callable[..., Any], lower_single: Callable[..., Any], inputs: list[Any]
) -> None:
    """custom_op._range_based_lowering_fn over _TWO_RANGES of an op with one
    implementation, on ``inputs``, with autotune_custom_op and _lower_single_impl (one
    winner for every range: inlined) replaced."""
    from torch._inductor.kernel import custom_op

    with (
        mock.patch.object(custom_op, "autotune_custom_op", autotune),
        mock.patch.object(custom_op, "_lower_single_impl", lower_single),
    ):
        custom_op._range_based_lowering_fn(
            processed_configs=[custom_op.CustomOpConfig(_implementation)],
            default_impl=_implementation,
            name="op",
            op_overload=None,
            input_gen_fns=None,
            tensor_name="x",
            dim_index=0,
            ranges=_TWO_RANGES,
            tensor_inputs=inputs,
            runtime_kwargs={},
            range_upper_bound=64,
        )


def check_ranges_tuned_at_their_last_size() -> None:
    """The range-based lowering asks hooks.tuned_ranges for a collective op's ranges,
    handing it ``tune_range(start, end)``, which tunes the range with the op's inputs
    made at ``end`` rows (the range's upper bound for an unbounded one) and returns
    the winner's ImplConfig, whose impl_func is the winning choice's decomposition:
    the ladder times each probe at its size through it."""
    from torch._inductor.kernel.collective import hooks
    from torch._inductor.kernel.custom_op import RangeBounds

    sizes: list[int] = []
    winners: list[Any] = []

    def autotune(*args: Any, user_input_gen_fns: Any, **kwargs: Any) -> Any:
        made = user_input_gen_fns["x"](torch.empty(7, 3))
        sizes.append(made.shape[0])
        return None, _WINNER

    def tuned_ranges(name, op, ranges, upper_bound, dispatch_on, tune_range):
        winners.extend([tune_range(5, 12), tune_range(13, math.inf)])
        return {RangeBounds(1, 12): winners[0], RangeBounds(13, math.inf): winners[1]}

    with mock.patch.object(hooks, "tuned_ranges", tuned_ranges):
        _lower_two_ranges(autotune, lambda *a, **k: None, [])
    if sizes != [12, 64]:
        raise ContractBroken(
            f"ranges ending at 12 and unbounded (upper bound 64) were tuned at {sizes}"
        )
    if [w.impl_func for w in winners] != [_implementation] * 2:
        raise ContractBroken(f"tune_range returned {winners}, not the winner's config")


def break_range_sizes() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.kernel import custom_op

    original = custom_op._create_range_input_gen_fn

    # Each range tuned at its first size.
    def at_start(base, dim_index, range_start, range_end, range_upper_bound):
        return original(base, dim_index, range_start, range_start, range_upper_bound)

    return mock.patch.object(custom_op, "_create_range_input_gen_fn", at_start)


def check_one_winner_is_inlined_as_chosen() -> None:
    """Where one implementation won every range, the range-based lowering inlines it
    with _lower_single_impl, given the winning choice's ``decomposition`` itself and the
    call site's inputs: choices._sharing_traces marks that decomposition with the
    graph's traces, which traced_once shares with the choice's."""
    inlined: list[tuple[Any, Any]] = []

    def lower_single(implementation: Any, *args: Any, **kwargs: Any) -> None:
        inputs = args[2] if len(args) > 2 else kwargs.get("tensor_inputs")
        inlined.append((implementation, inputs))

    site_inputs: list[Any] = []
    _lower_two_ranges(lambda *a, **k: (None, _WINNER), lower_single, site_inputs)
    if (
        len(inlined) != 1
        or inlined[0][0] is not _implementation
        or inlined[0][1] is not site_inputs
    ):
        raise ContractBroken(
            f"the winner of every range was not inlined as chosen: {inlined}"
        )


def break_one_winner_inlining() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.kernel import custom_op

    original = custom_op.ImplConfig

    # The winner wrapped before it is inlined.
    def wrapped(*args: Any, impl_func: Any, **kwargs: Any) -> Any:
        return original(*args, impl_func=lambda *a, **k: impl_func(*a, **k), **kwargs)

    return mock.patch.object(custom_op, "ImplConfig", wrapped)


def break_range_based_lowering() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.kernel import custom_op

    original = custom_op._range_based_lowering_fn

    # range_upper_bound renamed (and keyword-only).
    def _range_based_lowering_fn(*args: Any, upper_bound: int, **kwargs: Any) -> Any:
        return original(*args, range_upper_bound=upper_bound, **kwargs)

    return mock.patch.object(
        custom_op, "_range_based_lowering_fn", _range_based_lowering_fn
    )


# Names of the contract's ExternKernelChoices (each registers its kernel by name).
_EXTERN_CHOICES = itertools.count()


def check_extern_kernel_choices() -> None:
    """ExternKernelChoice(kernel, name=, has_out_variant=, op_overload=,
    use_fallback_kernel=) keeps what it is given."""
    from torch._inductor.select_algorithm import ExternKernelChoice

    op = torch.ops.aten.neg.default
    name = f"collective_contract_fallback_{next(_EXTERN_CHOICES)}"
    choice = ExternKernelChoice(
        op, name=name, has_out_variant=False, op_overload=op, use_fallback_kernel=True
    )
    got = (
        choice.name,
        choice.has_out_variant,
        choice.op_overload,
        choice.use_fallback_kernel,
    )
    if got != (name, False, op, True):
        raise ContractBroken(
            f"an ExternKernelChoice keeps (name, has_out_variant, "
            f"op_overload, use_fallback_kernel) as {got}"
        )
    has(
        "torch._inductor.select_algorithm.ExternKernelChoice",
        "kernel",
        "name",
        "has_out_variant",
        "op_overload",
        "use_fallback_kernel",
    )()


def break_extern_kernel_choices() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import select_algorithm

    class ExternKernelChoice(select_algorithm.ExternKernelChoice):  # type: ignore[misc]
        # has_out_variant renamed.
        def __init__(
            self,
            kernel: Any,
            cpp_kernel: Any = None,
            *,
            name: Any = None,
            out_variant: bool = True,
            op_overload: Any = None,
            use_fallback_kernel: bool = False,
            kernel_creator: Any = None,
        ) -> None:
            super().__init__(
                kernel,
                cpp_kernel,
                name=name,
                has_out_variant=out_variant,
                op_overload=op_overload,
                use_fallback_kernel=use_fallback_kernel,
                kernel_creator=kernel_creator,
            )

    return mock.patch.object(select_algorithm, "ExternKernelChoice", ExternKernelChoice)


# What the lowering probe's lowering does: set by each check that lowers through it.
_PROBE_LOWERINGS: list[Callable[[Any], Any]] = []


@functools.cache
def _copy_op(name: str) -> Any:
    """Custom op ``collective_contract::{name}``: its eager kernel a copy."""

    @torch.library.custom_op(f"collective_contract::{name}", mutates_args=())
    def copy(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @copy.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    return copy


@functools.cache
def _lowering_probe() -> Any:
    """A custom op (its eager kernel: a copy) lowered by _PROBE_LOWERINGS' last."""
    from torch._inductor import lowering

    probe = _copy_op("lowering_probe")

    @lowering.register_lowering(torch.ops.collective_contract.lowering_probe.default)
    def _lower(x: Any) -> Any:
        return _PROBE_LOWERINGS[-1](x)

    return probe


def _lowered_through(lower: Callable[[Any], Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, what probe(x.relu()) + 1 compiled gives for it), x's first size dynamic and
    the probe lowered by ``lower`` (given the probe's input, an IR node)."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    probe = _lowering_probe()
    _PROBE_LOWERINGS.append(lower)
    # Lowered every time (no graph caches), its kernels' code cached: a check and
    # its break build them once.
    torch._dynamo.reset()
    try:
        with (
            config.patch(fx_graph_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            x = torch.randn(6, 3)
            torch._dynamo.mark_dynamic(x, 0)
            return x, torch.compile(lambda t: probe(t.relu()) + 1, fullgraph=True)(x)
    finally:
        _PROBE_LOWERINGS.pop()
        torch._dynamo.reset()


def _traced(fn: Callable[..., Any], inputs: list[Any]) -> torch.fx.GraphModule:
    """``fn`` traced on IR nodes ``inputs`` as the dispatch traces (make_fx, Inductor's
    decompositions, symbolic sizes)."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.ir import ir_node_to_tensor
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    with V.fake_mode:
        return make_fx(
            fn, decomposition_table=select_decomp_table(), tracing_mode="symbolic"
        )(*(ir_node_to_tensor(t) for t in inputs))


_INLINE = "torch._inductor.codegen.subgraph.inline_subgraph_to_ir_nodes"


def check_subgraphs_inline() -> None:
    """inline_subgraph_to_ir_nodes(gm, inputs, name), in a lowering, gives the IR node
    of the traced graph ``gm`` applied to ``inputs``: the compiled code computes it."""
    from torch._inductor import ir

    has(_INLINE, "gm", "inputs", "name")()
    returned: list[Any] = []

    def lower(x: Any) -> Any:
        returned.append(
            resolve(_INLINE)(_traced(lambda t: t * 3, [x]), [x], "contract_probe")
        )
        return returned[-1] if isinstance(returned[-1], ir.TensorBox) else x

    x, out = _lowered_through(lower)
    if not isinstance(returned[0], ir.TensorBox):
        raise ContractBroken(
            f"inlining a graph of one output gave {type(returned[0]).__name__}"
        )
    if not torch.allclose(out, x.relu() * 3 + 1):
        raise ContractBroken("the compiled code does not compute the inlined graph")


def break_inline_subgraphs() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.codegen import subgraph

    original = subgraph.inline_subgraph_to_ir_nodes

    # Every output of the graph, as a list.
    def inline_subgraph_to_ir_nodes(gm: Any, inputs: list[Any], name: str) -> Any:
        out = original(gm, inputs, name)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    return mock.patch.object(
        subgraph, "inline_subgraph_to_ir_nodes", inline_subgraph_to_ir_nodes
    )


def check_inlining_asks_the_hooks() -> None:
    """inline_subgraph_to_ir_nodes inlines the graph that collective autotuning's
    ``hooks.to_inline(gm, inputs)`` gives for ``gm`` (patch 0009: an all-reduce of an
    input only the op reads becomes ``all_reduce_`` on it there)."""
    from torch._inductor.kernel.collective import hooks

    def to_inline(gm: Any, inputs: list[Any]) -> Any:
        return _traced(lambda t: t * 5, inputs)

    def lower(x: Any) -> Any:
        return resolve(_INLINE)(_traced(lambda t: t * 3, [x]), [x], "contract_probe")

    with mock.patch.object(hooks, "to_inline", to_inline):
        x, out = _lowered_through(lower)
    if not torch.allclose(out, x.relu() * 5 + 1):
        raise ContractBroken(
            "inline_subgraph_to_ir_nodes no longer inlines the graph hooks.to_inline "
            "gives it"
        )


def break_inlining_asks_the_hooks() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.codegen import subgraph
    from torch._inductor.kernel.collective import hooks

    original = subgraph.inline_subgraph_to_ir_nodes

    # Upstream's function rewritten without the hunk: it inlines ``gm`` as given.
    def inline_subgraph_to_ir_nodes(gm: Any, inputs: list[Any], name: str) -> Any:
        with mock.patch.object(hooks, "to_inline", lambda gm, inputs: gm):
            return original(gm, inputs, name)

    return mock.patch.object(
        subgraph, "inline_subgraph_to_ir_nodes", inline_subgraph_to_ir_nodes
    )


def check_ir_nodes_to_tensors() -> None:
    """ir_node_to_tensor gives a lowering's input as a fake tensor with its symbolic
    sizes (the dispatch is traced for every size), and gm_original_output_strides
    records a traced graph's output strides for its compile."""
    from torch._inductor import lowering

    seen: list[Any] = []

    def lower(x: Any) -> Any:
        from torch._inductor.ir import gm_original_output_strides, ir_node_to_tensor
        from torch._inductor.virtualized import V

        with V.fake_mode:
            seen.append(ir_node_to_tensor(x).shape)
        gm = _traced(lambda t: t * 3, [x])
        gm_original_output_strides(gm)
        seen.append(
            gm.graph.find_nodes(op="output")[0].meta.get("original_output_strides")
        )
        return lowering.mul(x, 1)

    _lowered_through(lower)
    shape, strides = seen
    if not isinstance(shape[0], torch.SymInt) or shape[1] != 3:
        raise ContractBroken(
            f"a lowering's input of a dynamic size reads as shape {shape}"
        )
    if not strides or len(strides[0]) != 2:
        raise ContractBroken(
            f"the traced graph's output strides were recorded as {strides}"
        )


def break_ir_nodes_to_tensors() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import ir

    original = ir.ir_node_to_tensor

    # Sizes given by their hints (as with replace_symbols_with_hints=True).
    def ir_node_to_tensor(x: Any, *args: Any, **kwargs: Any) -> Any:
        from torch._inductor.virtualized import V

        tensor = original(x, *args, **kwargs)
        return tensor.new_empty(V.graph.sizevars.optimization_hints(x.get_size()))

    return mock.patch.object(ir, "ir_node_to_tensor", ir_node_to_tensor)


def check_ir_classes() -> None:
    """A lowering's input made by a pointwise op reads as TensorBox > StorageBox >
    (ComputedBuffer >) Pointwise: the neighbours find a pointwise producer so."""
    from torch._inductor import ir, lowering

    has("torch._inductor.ir.ShapeAsConstantBuffer")()
    chains: list[list[str]] = []

    def lower(x: Any) -> Any:
        chain, node = [], x
        for cls in (ir.TensorBox, ir.StorageBox, ir.ComputedBuffer, ir.Pointwise):
            if isinstance(node, cls):
                chain.append(cls.__name__)
                node = getattr(node, "data", None)
        chains.append(chain)
        return lowering.mul(x, 1)

    _lowered_through(lower)
    if chains[0] not in (
        ["TensorBox", "StorageBox", "Pointwise"],
        ["TensorBox", "StorageBox", "ComputedBuffer", "Pointwise"],
    ):
        raise ContractBroken(f"the input made by relu reads as {chains[0]}")


def break_ir_classes() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import ir, lowering

    _lowering_probe()
    op = torch.ops.collective_contract.lowering_probe.default
    original = lowering.lowerings[op]

    # A custom op's inputs handed to its lowering as views of fixed strides (of the
    # realized buffer): a TensorBox of a ReinterpretView.
    def lower(x: Any) -> Any:
        x.realize()
        buffer = x.data.data
        layout = ir.FixedLayout(
            buffer.get_device(),
            buffer.get_dtype(),
            buffer.get_size(),
            buffer.get_stride(),
        )
        return original(ir.TensorBox(ir.ReinterpretView(data=buffer, layout=layout)))

    return mock.patch.dict(lowering.lowerings, {op: lower})


def check_fallback_handler() -> None:
    """fallback_handler(op, add_to_fallback_set=False) lowers ``op`` as a call of its
    eager kernel without adding ``op`` to Inductor's fallbacks."""
    from torch._inductor import lowering

    has("torch._inductor.lowering.fallback_handler", "add_to_fallback_set")()
    _lowering_probe()
    op = torch.ops.collective_contract.lowering_probe.default
    added: list[bool] = []

    def lower(x: Any) -> Any:
        out = lowering.fallback_handler(op, add_to_fallback_set=False)(x)
        added.append(op in lowering.fallbacks)
        lowering.fallbacks.discard(op)
        return out

    x, out = _lowered_through(lower)
    if added != [False]:
        raise ContractBroken(
            "fallback_handler(op, add_to_fallback_set=False) added the op "
            "to Inductor's fallbacks"
        )
    if not torch.allclose(out, x.relu() + 1):
        raise ContractBroken("the op's fallback does not compute the op")


def break_fallback_handler() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import lowering

    original = lowering.fallback_handler

    # add_to_fallback_set no longer honoured: every fallback is noted.
    def fallback_handler(kernel: Any, add_to_fallback_set: bool = True) -> Any:
        return original(kernel, add_to_fallback_set=True)

    return mock.patch.object(lowering, "fallback_handler", fallback_handler)


def check_custom_ops_fall_back() -> None:
    """Inductor lowers a custom op it has no lowering for as a call of the op: absent
    from ``lowering.lowerings`` until then, in ``lowering.fallbacks`` after; its own
    pointwise ops are lowerings, not fallbacks. only_calls_opaque_ops reads both."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config, lowering
    from torch._inductor.kernel.collective.choice_modules import only_calls_opaque_ops
    from torch.fx.experimental.proxy_tensor import make_fx

    _copy_op("opaque_probe")  # a custom op Inductor has no lowering for
    op = torch.ops.collective_contract.opaque_probe.default
    relu = torch.ops.aten.relu.default
    x = torch.randn(6, 3)
    traced = make_fx(op, tracing_mode="fake")(x)
    if op in lowering.lowerings or not only_calls_opaque_ops(traced):
        raise ContractBroken("a custom op has a lowering before Inductor met it")
    torch._dynamo.reset()
    try:
        with (
            config.patch(fx_graph_cache=False),
            functorch_config.patch(enable_autograd_cache=False),
        ):
            out = torch.compile(lambda t: op(t.relu()) + 1, fullgraph=True)(x)
        if not torch.allclose(out, x.relu() + 1):
            raise ContractBroken("the custom op's fallback does not compute the op")
        if op not in lowering.fallbacks or not only_calls_opaque_ops(traced):
            raise ContractBroken(
                "Inductor lowered a custom op it has no lowering for, not as a "
                "fallback in lowering.fallbacks"
            )
        if relu not in lowering.lowerings or relu in lowering.fallbacks:
            raise ContractBroken("aten.relu is no lowering of Inductor's own")
    finally:
        # Unmet again, for the next check.
        lowering.lowerings.pop(op, None)
        lowering.fallbacks.discard(op)
        torch._dynamo.reset()


def break_custom_ops_fall_back() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import lowering

    original = lowering.fallback_handler

    # A custom op lowered as a call without being noted among the fallbacks.
    def fallback_handler(kernel: Any, add_to_fallback_set: bool = True) -> Any:
        return original(kernel, add_to_fallback_set=False)

    return mock.patch.object(lowering, "fallback_handler", fallback_handler)


def check_functional_all_reduce_lowering() -> None:
    """Inductor lowers a functional all_reduce as ``_c10d_functional.all_reduce_`` on a
    copy of its input, a pointwise producer fused into that copy (one kernel), while
    ``config._collective.auto_select`` is off (its default); a graph input is copied
    the same way, and an all_gather_into_tensor's not at all. costs_alike_uncompiled
    times such a choice as traced, reducing the producer's output in place, and leaves
    the collectives that copy their inputs otherwise to the compile."""
    from torch._inductor import config
    from torch._inductor.graph import GraphLowering

    if config._collective.auto_select is not False:
        raise ContractBroken("config._collective.auto_select is no longer off")
    fc = torch.ops._c10d_functional
    codes: list[str] = []
    with (
        one_rank_group() as group,
        fresh_inductor(),
        mock.patch.object(GraphLowering, "save_output_code", codes.append),
    ):
        name = group.group_name
        x = torch.randn(8, 4)
        produced = torch.compile(
            lambda t: fc.wait_tensor(fc.all_reduce(t.neg(), "sum", name)),
            fullgraph=True,
        )(x)
        torch.compile(
            lambda t: fc.wait_tensor(fc.all_reduce(t, "sum", name)), fullgraph=True
        )(x)
        torch.compile(
            lambda t: fc.wait_tensor(fc.all_gather_into_tensor(t, 1, name)),
            fullgraph=True,
        )(x)
    if not torch.equal(produced, x.neg()):
        raise ContractBroken("a functional all_reduce of one rank changed its input")
    in_place = "torch.ops._c10d_functional.all_reduce_.default("
    kernels = [code.count("async_compile.cpp_pybinding(") for code in codes]
    if len(codes) != 3 or not all(in_place in code for code in codes[:2]):
        raise ContractBroken(
            "a functional all_reduce is no longer lowered as all_reduce_ on a copy"
        )
    if kernels != [1, 1, 0]:
        raise ContractBroken(
            f"functional collectives' input copies took {kernels} kernels (all_reduce "
            "of a produced input, of a graph input, all_gather_into_tensor of a graph "
            "input): expected 1, 1, 0"
        )


def break_functional_all_reduce_lowering() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import lowering

    # A functional all_reduce called as it is (out of place), not lowered in place.
    op = torch.ops._c10d_functional.all_reduce.default
    return mock.patch.dict(
        lowering.lowerings,
        {op: lowering.fallback_handler(op, add_to_fallback_set=False)},
    )


# Eager autograd's wrapper of a functional collective's output: never traced.
_AUTOGRAD_WRAPPER = "_c10d_functional::_wrap_tensor_autograd"


def check_functional_ops_communicate_or_wait() -> None:
    """Every op of the _c10d_functional namespace communicates (COLLECTIVE_OPS) or waits
    (waits.is_wait: wait_tensor, and from torch 2.15 on wait_tensors, a list's wait),
    but eager autograd's wrapper: with_waits and unwaited_collective tell a collective,
    whose output needs a wait, from a wait by these."""
    import torch.distributed  # registers the namespace's ops
    from torch._inductor.kernel.collective.waits import is_wait
    from torch._inductor.kernel.collective.detection import is_collective_op

    names = {
        name.split(".")[0]
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("_c10d_functional::")
    }
    unknown = []
    for name in sorted(names - {_AUTOGRAD_WRAPPER}):
        packet = getattr(torch.ops._c10d_functional, name.split("::")[1], None)
        if packet is not None and (
            is_collective_op(packet)
            or any(is_wait(getattr(packet, o)) for o in packet.overloads())
        ):
            continue
        unknown.append(name)
    if unknown:
        raise ContractBroken(
            f"functional ops that neither communicate nor wait, as far as collective "
            f"autotuning knows: {unknown}"
        )


def break_functional_ops_communicate_or_wait() -> contextlib.AbstractContextManager[
    Any
]:
    # A new op in the namespace (a wait of another name, say).
    original = torch._C._dispatch_get_all_op_names
    return mock.patch.object(
        torch._C,
        "_dispatch_get_all_op_names",
        lambda: [*original(), "_c10d_functional::wait_tensors_async"],
    )


def check_traced_with_decompositions() -> None:
    """make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="symbolic")
    traces Inductor's decompositions (hardswish to pointwise ops), at symbolic sizes."""
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    has(
        "torch.fx.experimental.proxy_tensor.make_fx",
        "f",
        "decomposition_table",
        "tracing_mode",
    )()
    gm = make_fx(
        lambda t: torch.nn.functional.hardswish(t),
        decomposition_table=select_decomp_table(),
        tracing_mode="symbolic",
    )(torch.randn(4, 3))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    if torch.ops.aten.hardswish.default in targets:
        raise ContractBroken("select_decomp_table() no longer decomposes hardswish")
    shape = gm.graph.find_nodes(op="placeholder")[0].meta["val"].shape
    if not isinstance(shape[0], torch.SymInt):
        raise ContractBroken(f"a symbolic trace's input reads as shape {shape}")


def check_python_dispatcher_is_disabled() -> None:
    """no_python_dispatcher() turns the Python dispatcher off inside it."""
    from torch._dispatch.python import enable_python_dispatcher, no_python_dispatcher

    key = torch._C.DispatchKey.PythonDispatcher
    with enable_python_dispatcher():
        with no_python_dispatcher():
            inside = torch._C._dispatch_tls_local_include_set().has(key)
        outside = torch._C._dispatch_tls_local_include_set().has(key)
    if inside or not outside:
        raise ContractBroken(
            f"the Python dispatcher is on: {inside} inside "
            f"no_python_dispatcher(), {outside} around it"
        )


def check_atomic_writes() -> None:
    """write_atomic(path, content, make_dirs=True) writes the file, and its folders."""
    has("torch._inductor.codecache.write_atomic", "make_dirs")()
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "decisions", "group", "site.json")
        resolve("torch._inductor.codecache.write_atomic")(
            path, '{"a": 1}', make_dirs=True
        )
        with open(path) as f:
            if f.read() != '{"a": 1}':
                raise ContractBroken("write_atomic wrote other content")


def break_atomic_writes() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor import codecache

    original = codecache.write_atomic

    # make_dirs no longer honoured: the caller makes the folders.
    def write_atomic(
        path_: str, content: Any, make_dirs: bool = False, **kwargs: Any
    ) -> None:
        original(path_, content, **kwargs)

    return mock.patch.object(codecache, "write_atomic", write_atomic)


def check_cache_dir() -> None:
    """cache_dir() is the folder TORCHINDUCTOR_CACHE_DIR names."""
    from torch._inductor.runtime import cache_dir_utils

    with (
        tempfile.TemporaryDirectory() as root,
        mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": root}),
    ):
        if cache_dir_utils.cache_dir() != os.path.abspath(root):
            raise ContractBroken(
                f"cache_dir() is {cache_dir_utils.cache_dir()}, not "
                "TORCHINDUCTOR_CACHE_DIR"
            )


def break_cache_dir() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.runtime import cache_dir_utils

    # TORCHINDUCTOR_CACHE_DIR no longer read.
    return mock.patch.object(
        cache_dir_utils, "cache_dir", cache_dir_utils.default_cache_dir
    )


def check_default_cache_dir() -> None:
    """default_cache_dir() does not follow TORCHINDUCTOR_CACHE_DIR: the decisions kept
    under it (collective_decisions.decisions_dir) outlive an engine's move of that."""
    from torch._inductor.runtime import cache_dir_utils

    before = cache_dir_utils.default_cache_dir()
    with (
        tempfile.TemporaryDirectory() as root,
        mock.patch.dict(os.environ, {"TORCHINDUCTOR_CACHE_DIR": root}),
    ):
        if cache_dir_utils.default_cache_dir() != before:
            raise ContractBroken(
                f"default_cache_dir() moved with TORCHINDUCTOR_CACHE_DIR to {root}"
            )


def break_default_cache_dir() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.runtime import cache_dir_utils

    # default_cache_dir() reading TORCHINDUCTOR_CACHE_DIR as cache_dir() does.
    return mock.patch.object(
        cache_dir_utils, "default_cache_dir", cache_dir_utils.cache_dir
    )


def check_fresh_cache_clears() -> None:
    """What clear_on_fresh_cache registers is cleared by fresh_cache()."""
    from torch._inductor.utils import clear_on_fresh_cache, fresh_cache

    state = [1]
    clear_on_fresh_cache(types.SimpleNamespace(cache_clear=state.clear))
    with fresh_cache():
        pass
    if state:
        raise ContractBroken(
            "fresh_cache() did not clear what clear_on_fresh_cache registered"
        )


def check_dynamo_timed() -> None:
    """dynamo_timed(key, log_pt2_compile_event=, dynamo_compile_column_us=) times its
    block under ``key`` in Dynamo's compilation metrics."""
    from torch._dynamo import utils

    key = "collective_contract_timed"
    utils.compilation_time_metrics.pop(key, None)
    with utils.dynamo_timed(
        key,
        log_pt2_compile_event=True,
        dynamo_compile_column_us="compile_time_autotune_time_us",
    ):
        pass
    if len(utils.compilation_time_metrics.get(key, ())) != 1:
        raise ContractBroken(
            f"the block was not timed under its key: "
            f"{utils.compilation_time_metrics.get(key)}"
        )
    has(
        "torch._dynamo.utils.dynamo_timed",
        "key",
        "log_pt2_compile_event",
        "dynamo_compile_column_us",
    )()


def break_dynamo_timed() -> contextlib.AbstractContextManager[Any]:
    from torch._dynamo import utils

    original = utils.dynamo_timed

    # dynamo_compile_column_us renamed.
    def dynamo_timed(
        key: str,
        phase_name: Any = None,
        log_pt2_compile_event: bool = False,
        metadata: Any = None,
        dynamo_compile_column: Any = None,
    ) -> Any:
        return original(
            key,
            phase_name,
            log_pt2_compile_event,
            metadata,
            dynamo_compile_column_us=dynamo_compile_column,
        )

    return mock.patch.object(utils, "dynamo_timed", dynamo_timed)


def check_trace_structured() -> None:
    """trace_structured(name, metadata_fn=, payload_fn=) logs the metadata and the
    payload to the structured trace (what tlparse reads)."""
    import logging

    from torch._logging._internal import trace_log

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    trace_log.addHandler(handler)
    try:
        torch._logging.trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "collective_contract", "encoding": "json"},
            payload_fn=lambda: '{"winner": "a"}',
        )
    finally:
        trace_log.removeHandler(handler)
    logged = [
        (r.metadata["artifact"], getattr(r, "payload", None))  # type: ignore
        for r in records
        if "artifact" in getattr(r, "metadata", {})
    ]
    if logged != [
        ({"name": "collective_contract", "encoding": "json"}, '{"winner": "a"}')
    ]:
        raise ContractBroken(f"the structured trace logged {logged}")
    has("torch._logging.trace_structured", "name", "metadata_fn", "payload_fn")()


def break_trace_structured() -> contextlib.AbstractContextManager[Any]:
    from torch import _logging

    original = _logging.trace_structured

    # The payload is no longer asked for (metadata only).
    def trace_structured(name: str, metadata_fn: Any = dict, **kwargs: Any) -> None:
        original(name, metadata_fn)

    return mock.patch.object(_logging, "trace_structured", trace_structured)


def check_dont_skip_tracing() -> None:
    """dont_skip_tracing(fn) makes Dynamo trace ``fn`` though it is a file of torch's
    own, which Dynamo skips: a dispatch's branches are such functions."""
    source = "def branch(t):\n    return t * 2\n"
    where = os.path.join(
        os.path.dirname(torch.__file__), "_inductor", "contract_probe.py"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, where, "exec"), namespace)
    branch = torch._dynamo.dont_skip_tracing(namespace["branch"])
    torch._dynamo.reset()
    try:
        out = torch.compile(lambda x: branch(x) + 1, fullgraph=True, backend="eager")(
            torch.ones(3)
        )
    finally:
        torch._dynamo.reset()
    if not torch.equal(out, torch.full((3,), 3.0)):
        raise ContractBroken(f"the traced function computed {out}")


def check_range_graph_tells() -> None:
    """What range graphs read to tell where a range cannot be guarded says so:
    statically_known_leq/gt, free_unbacked_symbols (a data-dependent size, which has no
    ladder), TracingContext.try_get() (None
    outside Dynamo), torch.compiler.is_exporting(), error_on_recompile and
    recompile_limit, and GraphLowering's is_backward."""
    import sympy
    from torch._dynamo import config as dynamo_config
    from torch._guards import TracingContext
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols, ShapeEnv

    has("torch._inductor.graph.GraphLowering.__init__", "is_backward")()
    env = ShapeEnv()
    sizes = SizeVarAllocator(env)
    if not (
        sizes.statically_known_leq(sympy.Integer(8), 16)
        and sizes.statically_known_gt(sympy.Integer(32), 16)
        and not sizes.statically_known_leq(sympy.Integer(32), 16)
    ):
        raise ContractBroken("statically_known_leq/gt misjudge 8 <= 16 and 32 > 16")
    backed = env.create_symintnode(env.create_symbol(8, source=_source()), hint=8)
    if free_unbacked_symbols(backed) or not free_unbacked_symbols(
        env.create_unbacked_symint()
    ):
        raise ContractBroken("free_unbacked_symbols no longer tells an unbacked size")
    contexts: list[Any] = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        contexts.append(TracingContext.try_get())
        return gm

    torch._dynamo.reset()
    try:
        torch.compile(lambda x: x * 5, backend=backend)(torch.ones(2))
    finally:
        torch._dynamo.reset()
    if TracingContext.try_get() is not None or None in contexts or not contexts:
        raise ContractBroken(
            f"TracingContext.try_get() is {TracingContext.try_get()} "
            f"outside Dynamo, {contexts} inside"
        )
    if torch.compiler.is_exporting():
        raise ContractBroken("is_exporting() is True outside export")
    with dynamo_config.patch(error_on_recompile=True, recompile_limit=8):
        knobs = (dynamo_config.error_on_recompile, dynamo_config.recompile_limit)
    if knobs != (True, 8):
        raise ContractBroken(f"error_on_recompile and recompile_limit read {knobs}")


def break_range_graph_tells() -> contextlib.AbstractContextManager[Any]:
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensorMode

    original = TracingContext.try_get
    default = TracingContext(FakeTensorMode())

    # A context outside Dynamo too (a default one, never None).
    return mock.patch.object(
        TracingContext, "try_get", staticmethod(lambda: original() or default)
    )


def check_dynamo_compiling() -> None:
    """torch.compiler.is_dynamo_compiling() is True while Dynamo traces, else False."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x + int(torch.compiler.is_dynamo_compiling())

    torch._dynamo.reset()
    try:
        traced = torch.compile(fn, fullgraph=True, backend="eager")(torch.zeros(2))
    finally:
        torch._dynamo.reset()
    if traced.tolist() != [1.0, 1.0] or fn(torch.zeros(2)).tolist() != [0.0, 0.0]:
        raise ContractBroken(
            f"is_dynamo_compiling() reads {traced.tolist()[0]:.0f} while "
            f"Dynamo traces, {fn(torch.zeros(1)).item():.0f} outside"
        )


def check_bundled_autograd_cache() -> None:
    """functorch's bundled_autograd_cache knob turns AOTAutograd's bundled cache on
    (should_bundle_autograd_cache), and off."""
    from torch._dynamo import config as dynamo_config
    from torch._functorch import config as functorch_config
    from torch._functorch._aot_autograd import autograd_cache

    seen = []
    for on in (True, False):
        with (
            functorch_config.patch(bundled_autograd_cache=on),
            dynamo_config.patch(caching_precompile=False),
        ):
            seen.append(bool(autograd_cache.should_bundle_autograd_cache()))
    if seen != [True, False]:
        raise ContractBroken(f"bundled_autograd_cache on, off: bundling {seen}")


def break_bundled_autograd_cache() -> contextlib.AbstractContextManager[Any]:
    from torch._functorch._aot_autograd import autograd_cache

    # Bundling always on: the knob no longer read.
    return mock.patch.object(
        autograd_cache, "should_bundle_autograd_cache", lambda: True
    )


def check_cuda_sleep() -> None:
    """torch.cuda._sleep(cycles) keeps the stream busy for that many cycles."""
    has("torch.cuda._sleep")()
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )
    start.record()
    torch.cuda._sleep(20_000_000)  # 5 ms or more at up to 4 GHz
    end.record()
    end.synchronize()
    if start.elapsed_time(end) < 2.0:
        raise ContractBroken(
            f"20M cycles of sleep took {start.elapsed_time(end):.3f} ms"
        )


def check_symmetric_memory() -> None:
    """symm_mem.empty(shape, dtype=, device=) and symm_mem.rendezvous(tensor, group
    name), as timing calls them."""
    from torch.distributed import _symmetric_memory as symm_mem

    has("torch.distributed._symmetric_memory.empty", "dtype", "device")()
    params = list(inspect.signature(symm_mem.rendezvous).parameters.values())
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) < 2:
        raise ContractBroken(f"rendezvous no longer takes (tensor, group): {params}")
    tensor = symm_mem.empty((4,), dtype=torch.float32, device="cuda")
    if tuple(tensor.shape) != (4,) or tensor.device.type != "cuda":
        raise ContractBroken(
            f"symm_mem.empty((4,)) made {tensor.shape} on {tensor.device}"
        )


def break_symmetric_memory() -> contextlib.AbstractContextManager[Any]:
    from torch.distributed import _symmetric_memory as symm_mem

    original = symm_mem.rendezvous

    # The group keyword-only.
    def rendezvous(tensor: torch.Tensor, *, group: Any) -> Any:
        return original(tensor, group)

    return mock.patch.object(symm_mem, "rendezvous", rendezvous)


_SUBGRAPH_CHOICE = "torch._inductor.codegen.subgraph.SubgraphChoiceCaller"


def check_choices_lower_only() -> None:
    """SubgraphChoiceCaller._compile_for_benchmarking(lower_only=True), as the benchmark
    on CPUs asks it, lowers a subgraph choice and gives the lowered graph."""
    from torch._inductor.codegen.subgraph import SubgraphChoiceCaller
    from torch._inductor.graph import GraphLowering
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    custom_op = _contract_all_reduce()
    op = torch.ops.collective_contract.all_reduce.default
    register_custom_op_autotuning(custom_op, configs=[CustomOpConfig(one_all_reduce)])
    original = SubgraphChoiceCaller._compile_for_benchmarking
    calls: list[tuple[Any, Any]] = []

    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = original(self, *args, **kwargs)
        except Exception as e:
            calls.append((kwargs, e))
            raise
        calls.append((kwargs, type(result)))
        return result

    with (
        one_rank_group() as group,
        fresh_inductor(),
        mock.patch.object(SubgraphChoiceCaller, "_compile_for_benchmarking", spy),
    ):
        torch.compile(lambda x: op(x, group.group_name) + 1, fullgraph=True)(
            torch.randn(4, 4)
        )
    lowered = [r for k, r in calls if k.get("lower_only")]
    if not lowered or any(
        not (isinstance(r, type) and issubclass(r, GraphLowering)) for r in lowered
    ):
        raise ContractBroken(f"lowering the choices for the benchmark gave {calls}")
    has(_SUBGRAPH_CHOICE + "._compile_for_benchmarking", "lower_only")()


def break_choices_lower_only() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.codegen.subgraph import SubgraphChoiceCaller

    original = SubgraphChoiceCaller._compile_for_benchmarking

    # lower_only renamed.
    def _compile_for_benchmarking(
        self: Any, only_lower: bool = False, defer_load: bool = False
    ) -> Any:
        return original(self, lower_only=only_lower, defer_load=defer_load)

    return mock.patch.object(
        SubgraphChoiceCaller, "_compile_for_benchmarking", _compile_for_benchmarking
    )


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
        known = (
            V.graph.sizevars.statically_known_leq(size, 16)
            if small
            else (V.graph.sizevars.statically_known_gt(size, 16))
        )
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
        compiled = torch.compile(
            lambda x: probe(x.relu()) + 0, backend=counter, dynamic=True
        )
        tags = []
        for n in (8, 12, 40, 64, 3):
            x = torch.rand(n, 4) + 0.5
            tags.append(int(round((compiled(x) / x).max().item())))
    if tags != [1, 1, 2, 2, 1]:
        raise ContractBroken(
            f"sizes 8, 12, 40, 64, 3 ran the branches {tags}, not [1, 1, 2, 2, 1]"
        )
    if counter.frame_count != 2:
        raise ContractBroken(
            f"{counter.frame_count} compiles for two ranges: guards set while lowering "
            "no longer choose the graph"
        )
    if seen[-2:] != [True, True]:
        raise ContractBroken(
            "Inductor does not know the guarded range for the rest of the compile"
        )


def break_lowering_guards() -> contextlib.AbstractContextManager[Any]:
    from torch._inductor.sizevars import SizeVarAllocator

    # A size variable evaluated by its hint without a guard.
    return mock.patch.object(
        SizeVarAllocator,
        "evaluate_expr",
        lambda self, expr, *a, **k: bool(expr.subs(self.shape_env.backed_var_to_val)),
    )


CONTRACTS: list[Contract] = [
    # What the overlay's edits do.
    Contract(
        "Scheduler.should_partition keeps a size dispatch inside CUDA-graph partitions",
        "dispatch.lower_size_dispatch",
        check_size_predicate_keeps_partitions,
        break_partitioner,
        needs_overlay=True,
    ),
    Contract(
        "the torch.cond lowering keeps CUDA graphs for a predicate over sizes",
        "dispatch.lower_size_dispatch",
        check_size_predicate_keeps_cudagraphs,
        break_cond_lowering,
        needs_overlay=True,
    ),
    Contract(
        "FxGraphCache's lookup passes over entries cached_graph_usable refuses",
        "graph_sessions.cached_graph_usable",
        check_cache_lookup_passes_over_unusable_entries,
        break_cache_lookup,
        needs_overlay=True,
    ),
    Contract(
        "FxGraphCache.load_with_key asks group_takes_cached_graph about every hit",
        "graph_sessions.group_takes_cached_graph",
        check_cache_hits_ask_the_group,
        break_cache_hits,
        needs_overlay=True,
    ),
    Contract(
        "AOTAutogradCache asks about bundled entries, and lets the group's errors out",
        "hooks.cached_entry_usable, hooks.group_takes_cached_entry",
        check_bundled_cache_entries_are_asked_about,
        break_bundled_cache_entries,
        needs_overlay=True,
    ),
    Contract(
        "a cache hit refused after its lookup recorded it leaves one artifact "
        "(CacheArtifactManager's records by type and key)",
        "recorded_artifacts.forget",
        check_refused_hits_leave_one_artifact,
        break_recorded_artifacts,
        needs_overlay=True,
    ),
    Contract(
        "a backend sees whether Dynamo checks the guards it adds (frame hooks, "
        "SHAPE_ENV guard, guard filters, aot_compile)",
        "range_graphs.unchecked_guards",
        check_backends_see_whether_guards_are_checked,
        break_frame_hooks,
        needs_overlay=True,
    ),
    Contract(
        "AOTAutogradCache lets the group's error out of loading a hit's FX graph",
        "graph_sessions.group_takes_cached_graph",
        check_graph_loads_let_the_groups_errors_out,
        break_graph_loads_let_the_groups_errors_out,
        needs_overlay=True,
    ),
    Contract(
        "CompiledFxGraph records the collective decisions its graph inlines",
        "graph_sessions.inlined_decisions",
        check_compiled_graphs_record_decisions,
        break_compiled_graphs,
        needs_overlay=True,
    ),
    Contract(
        "custom-op registration and selection reach collective autotuning's hooks",
        "hooks",
        check_collectives_reach_the_selector,
        break_selector,
        needs_overlay=True,
    ),
    # The diff's selector returns no node for a winner with a graph: custom_op inlines it.
    Contract(
        "custom_op inlines a winner's graph rather than the selector's node",
        "patches (select_algorithm.py)",
        check_winners_with_a_graph_are_inlined,
        replaced(
            "torch._inductor.codegen.subgraph.inline_subgraph_to_ir_nodes",
            lambda gm, inputs, name: None,
        ),
        needs_overlay=True,
    ),
    Contract(
        "ShapeEnv.error_on_new_guards refuses guards (backported to 2.11)",
        "choice_modules.compiled_module",
        check_guards_are_refused,
        replaced(
            "torch.fx.experimental.symbolic_shapes.ShapeEnv._check_frozen",
            lambda *a: None,
        ),
    ),
    # Upstream internals used as they are.
    Contract(
        "a guard lengthens ShapeEnv.guards",
        "choices.traced_once",
        check_guards_lengthen_the_guard_list,
        break_guard_list,
    ),
    Contract(
        "free_symbols finds the symbols of sizes",
        "choices.traced_once",
        check_free_symbols_of_sizes,
        # A range's static inputs would look like the site's symbolic ones.
        replaced(
            "torch.fx.experimental.symbolic_shapes.free_symbols", lambda *a: set()
        ),
    ),
    Contract(
        "Dynamo runs registered compile callbacks",
        "collective/dynamo_callbacks.py",
        check_compile_callbacks_fire,
        break_compile_callbacks,
    ),
    Contract(
        "a timing group of the group's backends runs collectives by its name",
        "collective_timing_group",
        check_timing_groups_run_collectives_by_name,
        break_timing_groups,
    ),
    Contract(
        "in-place torch.distributed collectives remap to functional ones",
        "collective/in_place.py",
        check_in_place_collectives_remap,
        break_in_place_remaps,
    ),
    Contract(
        "c10d's ops take a ProcessGroup by its script type",
        "collective/detection.py",
        check_process_groups_by_type,
        break_process_groups_by_type,
    ),
    Contract(
        "c10d resolves groups by name and lists a rank's groups",
        "_store_session",
        check_group_registry,
        break_group_registry,
    ),
    Contract(
        "Store primitives behave as the protocol needs",
        "_store_session",
        check_store_primitives,
        break_store_waits,
    ),
    Contract(
        "custom ops keep their Python function",
        "choices.code_identity",
        check_python_kernel_of_custom_ops,
        break_python_kernels,
    ),
    Contract(
        "SubgraphChoiceCaller compiles or only lowers a choice for benchmarking",
        "collective/choice_modules.py",
        check_choices_lower_only,
        break_choices_lower_only,
        needs_overlay=True,
    ),
    Contract(
        "inline_subgraph_to_ir_nodes(gm, inputs, name) inlines a traced graph",
        "collective/dispatch.py",
        check_subgraphs_inline,
        break_inline_subgraphs,
    ),
    Contract(
        "inline_subgraph_to_ir_nodes inlines the graph hooks.to_inline gives it",
        "patches (0009, codegen/subgraph.py): choice_modules.to_inline",
        check_inlining_asks_the_hooks,
        break_inlining_asks_the_hooks,
        needs_overlay=True,
    ),
    Contract(
        "_merge_config_and_runtime_kwargs(config_params, runtime_kwargs)",
        "collective/dispatch.py",
        check_merged_kwargs,
        # Runtime kwargs passed apart: the merge keeps the config's only.
        replaced(_MERGE, lambda config_params, runtime_kwargs: {**config_params}),
    ),
    Contract(
        "the range-based lowering's signature, which the diff calls",
        "patches (custom_op.py)",
        has(
            "torch._inductor.kernel.custom_op._range_based_lowering_fn",
            "processed_configs",
            "default_impl",
            "name",
            "op_overload",
            "input_gen_fns",
            "tensor_name",
            "dim_index",
            "ranges",
            "tensor_inputs",
            "runtime_kwargs",
            "range_upper_bound",
        ),
        break_range_based_lowering,
    ),
    Contract(
        "the range-based lowering hands hooks.tuned_ranges a tune_range that tunes a "
        "range at its last size and returns the winner's ImplConfig",
        "patches (custom_op.py); collective/ladder_lowering.py",
        check_ranges_tuned_at_their_last_size,
        break_range_sizes,
        needs_overlay=True,
    ),
    Contract(
        "one winner of every range is inlined by _lower_single_impl, as chosen",
        "choices._sharing_traces",
        check_one_winner_is_inlined_as_chosen,
        break_one_winner_inlining,
    ),
    Contract(
        "RangeImplGroup gives impl_func, impl_kwargs, impl_name and ranges",
        "collective/dispatch.py",
        check_range_impl_groups,
        break_range_impl_groups,
    ),
    Contract(
        "CustomOpConfig keeps decomposition and params",
        "choices.register",
        check_config_fields,
        break_config_fields,
    ),
    Contract(
        "ExternKernelChoice(kernel, name=, has_out_variant=, op_overload=, "
        "use_fallback_kernel=)",
        "choices.complete_default_choice",
        check_extern_kernel_choices,
        break_extern_kernel_choices,
    ),
    Contract(
        "ir_node_to_tensor and gm_original_output_strides",
        "collective/choice_modules.py",
        check_ir_nodes_to_tensors,
        break_ir_nodes_to_tensors,
    ),
    Contract(
        "IR classes the neighbours and the dispatch recognise",
        "collective/choice_modules.py",
        check_ir_classes,
        break_ir_classes,
    ),
    Contract(
        "fallback_handler(op, add_to_fallback_set=)",
        "hooks.lowered_once",
        check_fallback_handler,
        break_fallback_handler,
    ),
    Contract(
        "a functional all_reduce is lowered as all_reduce_ on a copy its producer fuses "
        "into, an all_gather_into_tensor without one (config._collective.auto_select "
        "off)",
        "choice_modules.costs_alike_uncompiled",
        check_functional_all_reduce_lowering,
        break_functional_all_reduce_lowering,
    ),
    Contract(
        "every functional collective op communicates or waits (wait_tensor, "
        "wait_tensors)",
        "waits.is_wait, waits.is_functional_collective",
        check_functional_ops_communicate_or_wait,
        break_functional_ops_communicate_or_wait,
    ),
    Contract(
        "a custom op without a lowering is lowered as a fallback (lowerings, fallbacks)",
        "choice_modules.only_calls_opaque_ops",
        check_custom_ops_fall_back,
        break_custom_ops_fall_back,
    ),
    Contract(
        "config.triton.autotune_pointwise=False leaves a pointwise kernel one config",
        "timing.build",
        check_one_pointwise_config_without_autotuning,
        break_autotune_pointwise,
        needs_cuda=True,
    ),
    Contract(
        "no_python_dispatcher",
        "collective/selection.py",
        check_python_dispatcher_is_disabled,
        # A no-op: the Python dispatcher stays on.
        replaced("torch._dispatch.python.no_python_dispatcher", contextlib.nullcontext),
    ),
    Contract(
        "write_atomic(path, content, make_dirs=)",
        "collective_decisions",
        check_atomic_writes,
        break_atomic_writes,
    ),
    Contract("cache_dir()", "collective_decisions", check_cache_dir, break_cache_dir),
    Contract(
        "default_cache_dir() does not follow TORCHINDUCTOR_CACHE_DIR",
        "collective_decisions.decisions_dir",
        check_default_cache_dir,
        break_default_cache_dir,
    ),
    Contract(
        "clear_on_fresh_cache registers what fresh_cache clears",
        "collective/records.py",
        check_fresh_cache_clears,
        # A decorator that registers nothing.
        replaced("torch._inductor.utils.clear_on_fresh_cache", lambda obj: obj),
    ),
    Contract(
        "dynamo_timed(key, log_pt2_compile_event=, dynamo_compile_column_us=)",
        "hooks",
        check_dynamo_timed,
        break_dynamo_timed,
    ),
    Contract(
        "trace_structured(name, metadata_fn=, payload_fn=)",
        "hooks",
        check_trace_structured,
        break_trace_structured,
    ),
    Contract(
        "make_fx(fn, decomposition_table=, tracing_mode=) and select_decomp_table",
        "collective/choice_modules.py",
        check_traced_with_decompositions,
        # Inductor's decompositions left to its lowerings: an empty table.
        replaced("torch._inductor.decomposition.select_decomp_table", dict),
    ),
    Contract(
        "dont_skip_tracing",
        "collective/dispatch.py",
        check_dont_skip_tracing,
        # Dynamo skips the function all the same.
        replaced("torch._dynamo.dont_skip_tracing", lambda fn=None: fn),
    ),
    Contract(
        "guards set through V.graph.sizevars while lowering choose the Dynamo "
        "frame's graph",
        "collective/range_graphs.py",
        check_lowering_guards_choose_the_graph,
        break_lowering_guards,
    ),
    Contract(
        "what tells range graphs where a range cannot be guarded",
        "collective/range_graphs.py",
        check_range_graph_tells,
        break_range_graph_tells,
    ),
    Contract(
        "torch.compiler.is_dynamo_compiling (no dispatch mode while Dynamo traces)",
        "waits.with_waits",
        check_dynamo_compiling,
        # False while Dynamo traces too.
        replaced("torch.compiler.is_dynamo_compiling", lambda: False),
    ),
    Contract(
        "the functorch bundled_autograd_cache knob",
        "test_collective_op_tuning_graphs: bundled graphs are the group's",
        check_bundled_autograd_cache,
        break_bundled_autograd_cache,
    ),
    Contract(
        "torch.cuda._sleep (GPU sleeps before a graph round)",
        "collective_benchmarking",
        check_cuda_sleep,
        # Returns at once.
        replaced("torch.cuda._sleep", lambda cycles: None),
        needs_cuda=True,
    ),
    Contract(
        "symmetric memory's empty, rendezvous (and enable_symm_mem_for_group "
        "where present)",
        "timing._move_to_symmetric_memory",
        check_symmetric_memory,
        break_symmetric_memory,
        needs_cuda=True,
    ),
]


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
            print(
                f"  FAILED       {contract.name} (relied on by {contract.used_by}): {e}"
            )
        else:
            print(f"  ok           {contract.name}")
    return 1 if failed else 0


if __name__ == "__main__":
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = tempfile.mkdtemp(prefix="collective_contracts_")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    sys.exit(main())
