# Owner(s): ["module: inductor"]
"""Fast unit tests of collective autotuning's pure pieces: no process group, no compile.

The protocol's pieces run on a ``HashStore`` (one process, real Store semantics); the
rest are pure functions of their arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading

import torch
import torch.distributed as dist

from torch._inductor.kernel.collective.choice_modules import (
    costs_alike_uncompiled,
    eager_module,
    Neighbours,
    only_calls_opaque_ops,
)
from torch._inductor.kernel.collective.choices import code_identity, unwaited_collective
from torch._inductor.kernel.collective.dispatch import (
    _bisection_order,
    _branches,
    incumbent,
    Incumbent,
)
from torch._inductor.kernel.collective.graph_sessions import (
    SiteReport,
    _decide_graph,
    _differing_settings,
    _failures,
    GroupChoice,
)
from torch._inductor.runtime.collective_benchmarking import (
    _EAGER_LEAD_IN_US,
    _graph_calls,
    _recaptured_calls,
    _lead_in_calls,
    _MIN_GRAPH_CALLS,
    _MIN_LONG_GRAPH_CALLS,
    _MAX_CALLS_PER_SAMPLE,
    _status,
    BenchmarkSettings,
    Candidate,
    ChoiceStatus,
    is_collective_op,
    prune,
    TimingMode,
    Verdict,
)
from torch._inductor.runtime.collective_decisions import (
    DecisionStore,
    Environment,
    StoredDecision,
)
from torch._inductor.runtime.collective_protocol import (
    CollectiveAutotuneError,
    CollectiveSession,
    Decision,
    DecisionKind,
    Join,
    MalformedMessageError,
    StoreClient,
)
from torch.testing._internal.common_utils import run_tests

from collective_harness import CollectiveTestCase
from torch.distributed._store_session import (
    ABORTED,
    Liveness,
    Participant,
    look_interval,
    Silence,
    wait_until,
)

# -- the ladder ------------------------------------------------------------------------------


LADDER = [
    "op_range_1_1",
    "op_range_2_4",
    "op_range_5_16",
    "op_range_17_64",
    "op_range_65_inf",
]


@dataclasses.dataclass(frozen=True)
class _Bounds:
    start: int
    end: float


@dataclasses.dataclass
class _Group:
    impl_name: str
    ranges: list


# -- detection -------------------------------------------------------------------------------


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


# -- code identity ---------------------------------------------------------------------------


def _all_reduce_graph() -> torch.fx.GraphModule:
    """A graph that all-reduces its input with a functional collective and waits."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    reduced = graph.call_function(
        torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0")
    )
    graph.output(
        graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (reduced,))
    )
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _factory(scale: float, offset=None):
    def impl(x):
        y = x * scale
        return offset(y) if offset is not None else y

    return impl


# -- the protocol on one process's Store -------------------------------------------------------


def _participant(store: dist.Store, rank: int, timeout: float) -> Participant:
    client = StoreClient(store, "HashStore", timeout)
    return Participant(client, Liveness(client, "ns", rank, lambda: ["g"]), rank, "ns")


class CountingSilence(Silence):
    """A Silence that counts its looks, and says when it looked ``until`` times."""

    def __init__(self, *args, until: int) -> None:
        super().__init__(*args)
        self.looks = 0
        self._until = until
        self.looked_enough = threading.Event()

    def look(self) -> None:
        super().look()
        self.looks += 1
        if self.looks >= self._until:
            self.looked_enough.set()


# -- exact collective detection ---------------------------------------------------------------


@torch.library.custom_op("cat_units::broadcast_weights", mutates_args=())
def _broadcast_weights(x: torch.Tensor) -> torch.Tensor:
    """Broadcasts a tensor's rows along its columns: no communication, whatever its name."""
    return x.sum(dim=1, keepdim=True).expand_as(x).clone()


@_broadcast_weights.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class TestCollectiveOpTuningUnits(CollectiveTestCase):
    def test_ranges_are_tuned_coarse_to_fine_largest_first(self):
        assert _bisection_order(1) == [0]
        assert _bisection_order(2) == [1, 0]
        assert _bisection_order(8) == [7, 0, 3, 1, 5, 2, 4, 6]
        for n in range(1, 20):
            assert sorted(_bisection_order(n)) == list(range(n))

    def test_a_range_keeps_the_nearest_decided_winner_below_else_above(self):
        assert incumbent(LADDER, "op_range_1_1", {}.get) is None
        assert incumbent(LADDER, "op_range_5_16", {"op_range_2_4": "x"}.get) == (
            Incumbent("x", "4", between=False)
        )
        below_and_above = {"op_range_1_1": "x", "op_range_65_inf": "y"}.get
        assert incumbent(LADDER, "op_range_5_16", below_and_above) == (
            Incumbent("x", "1", between=False)
        )
        # The smallest range, timed after the largest, has only ranges above.
        assert incumbent(LADDER, "op_range_1_1", {"op_range_65_inf": "y"}.get) == (
            Incumbent("y", "inf", between=False)
        )

    def test_a_range_between_two_that_agree_is_screened_against_their_winner(self):
        agree = {"op_range_1_1": "a", "op_range_65_inf": "a"}.get
        assert incumbent(LADDER, "op_range_5_16", agree) == Incumbent(
            "a", "1 and inf", between=True
        )
        # The nearest decided neighbours count, not the farthest.
        nearest = {"op_range_1_1": "a", "op_range_2_4": "b", "op_range_65_inf": "b"}.get
        assert incumbent(LADDER, "op_range_5_16", nearest) == Incumbent(
            "b", "4 and inf", between=True
        )

    def test_a_screen_stops_once_no_choice_is_clearly_faster_than_the_incumbent(self):
        candidates = [Candidate(n, lambda: None) for n in ("a", "b", "c")]

        def stops(low, high, incumbent, rounds=3):
            mid = [(lo + hi) / 2 for lo, hi in zip(low, high)]
            return prune(
                [0, 1, 2], low, mid, high, set(), rounds, 3, candidates, incumbent
            )[1]

        # b leads a by less than the samples' spread: a, the incumbent, is unbeaten.
        overlapping = ([10.0, 9.5, 30.0], [10.4, 10.2, 31.0])
        assert stops(*overlapping, incumbent=0)
        # Without an incumbent the tie needs twice the rounds.
        assert not stops(*overlapping, incumbent=None)
        # b and c clearly beat the incumbent and are close: sampling goes on.
        assert not stops([10.0, 5.0, 5.05], [10.4, 5.2, 5.25], incumbent=0)

    def test_dispatch_branches_follow_sizes_and_merge_neighbours_only(self):
        a = _Group("a", [_Bounds(1, 4), _Bounds(65, math.inf)])
        b = _Group("b", [_Bounds(5, 16), _Bounds(17, 64)])
        branches = _branches([a, b])
        # a up to 4, b up to 64 (two neighbouring ranges merged), a again above.
        assert [(top, g.impl_name) for top, g in branches] == [
            (4, "a"),
            (64, "b"),
            (math.inf, "a"),
        ]

    # -- sampling ----------------------------------------------------------------------

    def test_prune_drops_only_the_clearly_slower_and_stops_on_a_tie(self):
        names = ["lead", "close", "slow", "kept"]
        candidates = [type("C", (), {"name": n}) for n in names]
        low, mid, high = (
            [9.0, 9.5, 15.0, 30.0],
            [10.0, 10.1, 16.0, 31.0],
            [11.0, 10.5, 17.0, 32.0],
        )
        live, settled = prune(
            [0, 1, 2, 3],
            low,
            mid,
            high,
            {3},
            rounds=3,
            min_rounds=3,
            candidates=candidates,
        )
        assert (
            live == [0, 1, 3] and not settled
        )  # "slow" dropped; "kept" kept; a tie needs 6 rounds
        live, settled = prune(
            [0, 1, 3],
            low,
            mid,
            high,
            {3},
            rounds=6,
            min_rounds=3,
            candidates=candidates,
        )
        assert live == [0, 1, 3] and settled  # "close" within 2% of the leader

    def test_an_eager_sample_leads_in_for_a_fixed_time_not_a_fixed_count(self):
        # About _EAGER_LEAD_IN_US of untimed calls, whatever a call costs: many short
        # calls, a few long ones, none for a call longer than the lead-in; and never
        # more than a sample's most calls, nor any for a choice that was not timed.
        assert _lead_in_calls(_EAGER_LEAD_IN_US / 10) == 10
        assert _lead_in_calls(_EAGER_LEAD_IN_US / 2.5) == 2
        assert _lead_in_calls(_EAGER_LEAD_IN_US * 1.5) == 0
        assert _lead_in_calls(1e-6) == _MAX_CALLS_PER_SAMPLE
        assert _lead_in_calls(math.inf) == 0 and _lead_in_calls(0.0) == 0

    def test_a_captured_batch_holds_many_calls_unless_one_call_lasts_a_sample(self):
        # A call shorter than a sample keeps the floor, however long it read.
        assert _graph_calls(500.0, 10.0) == 50
        assert _graph_calls(500.0, 150.0) == _MIN_GRAPH_CALLS
        assert _graph_calls(500.0, 499.0) == _MIN_GRAPH_CALLS
        # A call as long as a sample: a few back to back time it (a first call that
        # paid once is captured again from its first replay's share, which reads short).
        assert _graph_calls(500.0, 500.0) == _MIN_LONG_GRAPH_CALLS
        assert _graph_calls(500.0, 924.0) == _MIN_LONG_GRAPH_CALLS < _MIN_GRAPH_CALLS
        assert _graph_calls(500.0, math.inf) == _MIN_GRAPH_CALLS
        # Captured again from its first replay: the floor, as its rivals sized from
        # their eager first calls get at small sizes, never more calls than they.
        assert _recaptured_calls(500.0, 10.0) == _MIN_GRAPH_CALLS
        assert _recaptured_calls(500.0, 499.0) == _MIN_GRAPH_CALLS
        assert _recaptured_calls(500.0, 600.0) == _MIN_LONG_GRAPH_CALLS

    def test_a_screen_status_reads_the_same_from_every_ranks_verdicts(self):
        ok, wrong = (
            [float(Verdict.OK), 0.0, 5.0],
            [float(Verdict.WRONG_OUTPUT), 7.95, 5.0],
        )
        assert _status([ok, ok], "").status is ChoiceStatus.OK
        assert _status([wrong, ok], "") == (
            ChoiceStatus.REJECTED,
            "rejected by group ranks [0] (group rank 0: rejected: output differs from the reference (max "
            "abs error 7.95)), accepted by group ranks [1]: a result that differs between ranks suggests it "
            "reads data before a collective completed",
        )
        wrote = [float(Verdict.WROTE_INPUT), 1.0, 5.0]
        assert (
            "writes into input 1, which the op does not declare it mutates"
            in _status([wrote, wrote], "").reason
        )
        raised = [float(Verdict.RAISED), 0.0, math.inf]
        assert _status([raised, raised], "raised on every rank: x") == (
            ChoiceStatus.RAISED,
            "raised on every rank: x",
        )

    def test_settings_are_validated_in_one_place(self):
        good = BenchmarkSettings(20, 5, 30.0, 1000.0, 500.0, "auto", True, 16384, 4)
        good.validate()
        with self.assertRaisesRegex(
            ValueError, "collective_benchmark_nruns=0: an int >= 1"
        ):
            dataclasses.replace(good, nruns=0).validate()
        with self.assertRaisesRegex(
            ValueError, "collective_autotune_dynamic_ratio=1: an int >= 2"
        ):
            dataclasses.replace(good, dynamic_ratio=1).validate()
        with self.assertRaisesRegex(
            ValueError, "collective_benchmark_timeout=-1: seconds, > 0"
        ):
            dataclasses.replace(good, timeout=-1).validate()
        assert set(good.knobs()) == {
            "collective_benchmark_nruns",
            "collective_benchmark_warmup",
            "collective_benchmark_timeout",
            "collective_benchmark_sample_us",
            "collective_benchmark_graph_sample_us",
            "collective_benchmark_mode",
            "collective_autotune_dynamic",
            "collective_autotune_dynamic_max",
            "collective_autotune_dynamic_ratio",
        }

    def test_upstreams_own_collective_benchmarking_is_replaced_not_left_behind(self):
        import inspect

        from torch._inductor import utils
        from torch._inductor.codegen.subgraph import SubgraphChoiceCaller
        from torch._inductor.select_algorithm import AlgorithmSelectorCache

        for gone in ("benchmark_collective_choice", "_run_collective_benchmark"):
            assert not hasattr(AlgorithmSelectorCache, gone), gone
        assert not hasattr(SubgraphChoiceCaller, "benchmark_collective")
        assert not hasattr(utils, "is_collective_op") and not hasattr(
            utils, "COLLECTIVE_OPS"
        )
        # The flag routes a collective op at the entry point, and goes no further.
        assert (
            "is_collective"
            in inspect.signature(AlgorithmSelectorCache.__call__).parameters
        )
        for method in (
            "benchmark",
            "autotune",
            "do_autotuning",
            "benchmark_choices",
            "make_benchmark_fn",
        ):
            parameters = inspect.signature(
                getattr(AlgorithmSelectorCache, method)
            ).parameters
            assert "is_collective" not in parameters, method

    def test_reading_a_collectives_output_before_waiting_is_found(self):
        fc = torch.ops._c10d_functional

        def early(x):
            out = fc.all_reduce(x, "sum", "0")
            return out * 2  # before wait_tensor

        def waited(x):
            return fc.wait_tensor(fc.all_reduce(x, "sum", "0")) * 2

        from torch.fx.experimental.proxy_tensor import make_fx

        x = torch.randn(4)
        assert (
            "reads the output of _c10d_functional::all_reduce before wait_tensor"
            in unwaited_collective(make_fx(early, tracing_mode="fake")(x))
        )
        assert unwaited_collective(make_fx(waited, tracing_mode="fake")(x)) == ""

    def test_only_a_graph_of_ops_inductor_calls_as_they_are_is_timed_uncompiled(self):
        import collective_ops as ops
        from torch.fx.experimental.proxy_tensor import make_fx

        fc = torch.ops._c10d_functional

        def traced(fn):
            return make_fx(fn, tracing_mode="fake")(torch.randn(4, 2))

        # An opaque op, alone or twice (nothing between them to fuse).
        assert only_calls_opaque_ops(traced(lambda x: ops.opaque_all_reduce(x, "0")))
        assert only_calls_opaque_ops(
            traced(lambda x: ops.opaque_all_reduce(ops.scale(x), "0"))
        )
        # Inductor lowers functional collectives (the input's copy fuses with its
        # producer), pointwise ops, and an opaque op beside either.
        assert not only_calls_opaque_ops(
            traced(lambda x: fc.wait_tensor(fc.all_reduce(x, "sum", "0")))
        )
        assert not only_calls_opaque_ops(
            traced(lambda x: ops.opaque_all_reduce(x, "0") + 1)
        )
        # Nothing called: nothing to time as called.
        assert not only_calls_opaque_ops(traced(lambda x: x))

    def test_functional_collectives_are_timed_as_traced_where_a_compile_adds_nothing(
        self,
    ):
        import types

        import collective_ops as ops
        from collective_contracts import one_rank_group
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.utils._python_dispatch import TorchDispatchMode

        fc = torch.ops._c10d_functional
        alone, fused = Neighbours(), Neighbours(producer=True, consumer=True)

        def traced(fn):
            return make_fx(fn, tracing_mode="fake")(torch.randn(4, 2))

        def reduced(x, group="0"):
            return fc.wait_tensor(fc.all_reduce(x, "sum", group))

        # Inductor lowers it as a copy of the input into which the producer computes,
        # and all_reduce_: the work of the producer's stand-in reduced in place.
        assert costs_alike_uncompiled(traced(lambda x: reduced(x)), fused)
        # The output of a kernel that only this op reads (a matmul's) is reduced in
        # place with no copy at all: its producer's stand-in is reduced in place too.
        owned = Neighbours(owned_input=True)
        assert costs_alike_uncompiled(traced(lambda x: reduced(x)), owned)
        # A graph input's copy is a Triton kernel where the op called copies with a
        # memcpy (so for an all_reduce_coalesced, a broadcast): compiled.
        assert not costs_alike_uncompiled(traced(lambda x: reduced(x)), alone)
        coalesced = traced(
            lambda x: fc.wait_tensor(fc.all_reduce_coalesced([x], "sum", "0")[0])
        )
        broadcast = traced(lambda x: fc.wait_tensor(fc.broadcast(x, 0, "0")))
        for graph in (coalesced, broadcast):
            assert not costs_alike_uncompiled(graph, alone)
            assert not costs_alike_uncompiled(graph, fused)
        # A collective that takes its input as it is: alike without a producer, but a
        # produced input that goes elsewhere than its one all-reduce is the compile's
        # (where the producer's result lives is the compile's to say).
        gathered = traced(
            lambda x: ops.opaque_all_reduce(
                fc.wait_tensor(fc.all_gather_into_tensor(x, 2, "0")), "0"
            )
        )
        assert costs_alike_uncompiled(gathered, alone)
        assert not costs_alike_uncompiled(gathered, fused)
        both = traced(lambda x: (ops.opaque_all_reduce(x, "0"), reduced(x)))
        assert not costs_alike_uncompiled(both, fused)
        # An all-reduce of a value the graph computes, which Inductor may reduce in
        # place without a copy, and Inductor's own pointwise ops: compiled.
        assert not costs_alike_uncompiled(
            traced(lambda x: reduced(ops.opaque_all_reduce(x, "0"))), alone
        )
        assert not costs_alike_uncompiled(traced(lambda x: reduced(x * 2)), alone)
        assert not costs_alike_uncompiled(traced(lambda x: x), alone)

        class Calls(TorchDispatchMode):
            def __init__(self):
                super().__init__()
                self.names: list[str] = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(str(func))
                return func(*args, **(kwargs or {}))

        with one_rank_group() as group:
            gm = make_fx(lambda x: reduced(x, group.group_name))(torch.randn(4, 2))
            choice = types.SimpleNamespace(gm=gm, sym_input_values=())
            x = torch.randn(4, 2)
            for neighbours, called, expected in (
                (fused, "_c10d_functional.all_reduce_.default", x),
                (owned, "_c10d_functional.all_reduce_.default", -x),
                (alone, "_c10d_functional.all_reduce.default", x),
            ):
                with Calls() as calls:
                    (out,) = eager_module(choice, neighbours).call([x])
                # One rank: the sum is its own tensor, negated by each stand-in.
                torch.testing.assert_close(out, expected)
                # The producer's stand-in is reduced in place; a graph input is copied
                # (by the functional all_reduce: on a CPU, where every choice runs so).
                assert called in calls.names, calls.names

    def test_an_owned_inputs_producer_runs_before_a_compiled_choice_never_fused(self):
        import types

        from torch._inductor.kernel.collective.choice_modules import AfterOwnedInput

        owned = Neighbours(owned_input=True, consumer=True)
        # Part of the key; compiled with the consumer only (nothing fuses with the
        # kernel computing the input in the model, a matmul, say).
        assert str(owned) == "owned-input+consumer"
        assert owned.fused == Neighbours(consumer=True)
        assert Neighbours(producer=True).fused == Neighbours(producer=True)
        called = []
        module = types.SimpleNamespace(call=lambda args: called.append(args) or [0])
        x, y = torch.randn(3), torch.randn(3)
        # The stand-in negates the first tensor, after the symbolic sizes, each call.
        AfterOwnedInput(module, sym_inputs=1).call([7, x, y])
        ((size, first, second),) = called
        assert size == 7 and second is y
        torch.testing.assert_close(first, -x)

    def test_an_inlined_graph_is_left_alone_while_collective_autotuning_is_off(self):
        from unittest import mock

        from torch._inductor import config
        from torch._inductor.kernel.collective import choice_modules

        # A choice that all-reduces its first input: patch 0006's hook asks whether the
        # call site owns that input, unless collective autotuning is off.
        gm = _all_reduce_graph()
        asked = []

        def neighbours_of_site(inputs):
            asked.append(inputs)
            return Neighbours()

        with mock.patch.object(
            choice_modules, "neighbours_of_site", neighbours_of_site
        ):
            with config.patch(collective_autotune=False):
                assert choice_modules.to_inline(gm, ["site"]) is gm
            assert asked == []
            with config.patch(collective_autotune=True):
                assert choice_modules.to_inline(gm, ["site"]) is gm  # not owned
            assert asked == [["site"]]

    def test_default_mode_times_a_keys_choices_as_traced_all_or_none(self):
        import types

        import collective_ops as ops
        from torch._inductor.kernel.collective.timing import timed_as_traced
        from torch.fx.experimental.proxy_tensor import make_fx

        fc = torch.ops._c10d_functional
        fused = Neighbours(producer=True, consumer=True)

        def choice(fn):
            gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 2))
            return types.SimpleNamespace(gm=gm, _compile_for_benchmarking=None)

        opaque = choice(lambda x: ops.opaque_all_reduce(x, "0"))
        functional = choice(lambda x: fc.wait_tensor(fc.all_reduce(x, "sum", "0")))
        pointwise = choice(lambda x: ops.opaque_all_reduce(x, "0") * 2)
        own = types.SimpleNamespace()  # the op's own: called as it is, never compiled
        cpu, gpu = torch.device("cpu"), torch.device("cuda")
        alike = {"own": own, "opaque": opaque, "functional": functional}
        mixed = {**alike, "pointwise": pointwise}
        for mode in TimingMode:
            assert timed_as_traced(alike, gpu, fused, mode) == {"opaque", "functional"}
            # On a CPU every subgraph choice runs as traced.
            assert timed_as_traced(mixed, cpu, fused, mode) == {
                "opaque",
                "functional",
                "pointwise",
            }
        # A choice with pointwise work of its own is compiled; in graph mode the others
        # are still timed as traced (a replay costs the device's work), in the default
        # mode they are compiled too, to launch from the host as that one does.
        assert timed_as_traced(mixed, gpu, fused, TimingMode.GRAPH) == {
            "opaque",
            "functional",
        }
        assert timed_as_traced(mixed, gpu, fused, TimingMode.EAGER) == set()

    def test_an_unwaited_collective_is_waited_for_at_its_first_read_and_at_the_output(
        self,
    ):
        from torch._inductor.kernel.collective.waits import with_waits
        from torch.fx.experimental.proxy_tensor import make_fx

        fc = torch.ops._c10d_functional
        x = torch.randn(4)

        def scaled(x):  # upstream's "avg times world size": reads before waiting
            out = fc.all_reduce_(x.clone(), "avg", "0")
            return out * 2

        def returned(x):  # upstream's "sum": returns the output unwaited
            return fc.all_reduce_(x.clone(), "sum", "0")

        for fn, expected in [
            (
                scaled,
                [
                    "aten.clone.default",
                    "_c10d_functional.all_reduce_.default",
                    "_c10d_functional.wait_tensor.default",
                    "aten.mul.Tensor",
                ],
            ),
            (
                returned,
                [
                    "aten.clone.default",
                    "_c10d_functional.all_reduce_.default",
                    "_c10d_functional.wait_tensor.default",
                ],
            ),
        ]:
            unwaited = make_fx(fn, tracing_mode="fake")(x)
            assert unwaited_collective(unwaited) != "", fn.__name__
            gm = make_fx(with_waits(fn, None), tracing_mode="fake")(x)
            assert _targets(gm) == expected, (fn.__name__, _targets(gm))
            assert unwaited_collective(gm) == "", fn.__name__

    def test_an_implementation_that_waits_is_traced_as_written(self):
        from torch._inductor.kernel.collective.waits import with_waits
        from torch.fx.experimental.proxy_tensor import make_fx

        fc = torch.ops._c10d_functional

        def overlapped(x, w):  # the wait comes after independent work: kept there
            out = fc.all_reduce(x, "sum", "0")
            y = w @ w
            return fc.wait_tensor(out) + y

        args = (torch.randn(4, 4), torch.randn(4, 4))
        plain = make_fx(overlapped, tracing_mode="fake")(*args)
        waited = make_fx(with_waits(overlapped, None), tracing_mode="fake")(*args)
        assert waited.code == plain.code

    # -- agreeing ----------------------------------------------------------------------

    def test_failures_read_the_same_on_every_rank(self):
        per_rank = [{"a": "boom"}, {"a": "boom", "b": "no symmetric memory"}, {}]
        assert _failures(per_rank) == {
            "a": "group ranks [0, 1]: boom",
            "b": "group rank 1: no symmetric memory",
        }

    def test_settings_that_differ_are_named_by_variable(self):
        same = {"collective_benchmark_warmup": 5, "collective_benchmark_mode": "auto"}
        assert _differing_settings([same, same]) == ""
        other = {**same, "collective_benchmark_warmup": 6}
        why = _differing_settings([same, other, same])
        assert "TORCHINDUCTOR_COLLECTIVE_BENCHMARK_WARMUP" in why
        assert "5 on group ranks [0, 2], 6 on group ranks [1]" in why
        decision = _decide_graph([Join("", same), Join("", other)])
        assert decision.kind == DecisionKind.MISMATCH

    def test_a_cached_graph_is_loaded_only_where_every_rank_loaded_the_same(self):
        settings = {"collective_benchmark_warmup": 5}
        assert _decide_graph([Join("g", settings)] * 2).kind == DecisionKind.LOAD
        mixed = _decide_graph(
            [
                Join("g", settings),
                Join("", settings),
            ]
        )
        assert (
            mixed.kind == DecisionKind.COMPILE
            and "group ranks [0] hit their caches" in mixed.reason
        )

    def test_messages_round_trip_through_their_encodings(self):
        report = SiteReport(
            "k", ("a", "b"), GroupChoice("a", True), None, "a", {"b": "boom"}, True
        )
        for message in [
            Decision(DecisionKind.FALLBACK, "late"),
            GroupChoice("x", provisional=True, unsure=True),
            Join("", {"collective_benchmark_warmup": 5}),
            report,
        ]:
            self.assertEqual(type(message).decode(message.encode().encode()), message)
        self.assertEqual(SiteReport.decode(report.encode()).decided.unsure, False)

    def test_a_malformed_message_names_its_field(self):
        for cls, raw, says in [
            (Decision, '{"kind": "guess", "reason": ""}', "kind is not"),
            (Decision, '{"kind": "load"}', "not a Decision"),
            (GroupChoice, '["x", true]', "not a GroupChoice"),
            (
                GroupChoice,
                '{"winner": 1, "provisional": false, "unsure": false}',
                "winner",
            ),
            (Join, "{not json", "not JSON"),
        ]:
            with self.assertRaisesRegex(MalformedMessageError, says):
                cls.decode(raw)
        wire = json.loads(SiteReport("k", ("a",), None, None, None, {}).encode())
        for field, value in [("choices", "a"), ("failed", {"a": 1}), ("built", 1)]:
            with self.assertRaisesRegex(CollectiveAutotuneError, field):
                SiteReport.from_wire({**wire, field: value})

    def test_code_identity_follows_the_code_not_the_name(self):
        assert code_identity(_factory(2.0)) == code_identity(_factory(2.0))
        assert code_identity(_factory(2.0)) != code_identity(
            _factory(3.0)
        )  # a value closed over
        assert code_identity(_factory(2.0, lambda y: y + 1)) != code_identity(
            _factory(2.0, lambda y: y - 1)
        )

        def a(x):
            return x + 1

        def b(x):
            return x + 2

        b.__name__ = b.__qualname__ = a.__qualname__
        assert code_identity(a) != code_identity(b)  # same name, other code

    # -- decisions on disk -------------------------------------------------------------

    def test_a_stored_decision_is_read_back_and_anything_else_is_a_miss(self):
        store = DecisionStore(self.tmp_path)
        env = Environment(2, torch.__version__, "gloo", "cpu")
        decision = StoredDecision("key", env, "winner", {"winner": 5.0})
        store.save(decision)
        self.assertEqual(store.load("key", env), decision)
        other = dataclasses.replace(env, group_size=4)
        self.assertIsNone(store.load("key", other))  # another environment
        self.assertIsNone(store.load("other", env))
        (path,) = self.tmp_path.glob("*.json")
        written = json.loads(path.read_text())
        for text in [
            "{not json",
            json.dumps({**written, "format": 0}),  # an older format
            json.dumps({**written, "winner": 3}),
            json.dumps({**written, "environment": other.to_wire()}),  # edited
        ]:
            path.write_text(text)
            self.assertIsNone(store.load("key", env))

    def test_a_vote_costs_each_rank_four_requests_and_returns_every_outcome(self):
        store = dist.HashStore()
        members = [_participant(store, r, 5.0) for r in range(3)]
        sessions = [
            CollectiveSession(m, "g", "s", r, [0, 1, 2], 5.0)
            for r, m in enumerate(members)
        ]
        results: dict[int, list[str]] = {}
        threads = [
            threading.Thread(
                target=lambda r=r: results.__setitem__(
                    r, sessions[r].vote("t", f"o{r}")
                )
            )
            for r in range(3)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert all(results[r] == ["o0", "o1", "o2"] for r in range(3))
        assert [m.client.requests for m in members] == [4, 4, 4]

    def test_silence_ends_a_wait_unless_the_group_progresses_and_an_abort_ends_it_at_once(
        self,
    ):
        store = dist.HashStore()
        waiter, worker = _participant(store, 0, 0.4), _participant(store, 1, 0.4)
        silence = Silence(waiter, "g", [0, 1], 0.4)
        assert not wait_until(waiter, ["never"], silence)
        # It ended because its deadline passed, not before: silence counts from its first look.
        assert silence.expired() and waiter.waited_s >= silence.seconds

        # A working peer keeps the wait alive for as long as it works: here until the waiter
        # looked more often than a silent group lets it (after its first look, one per look
        # interval until the silence ends).
        silent_looks = 1 + math.ceil(silence.seconds / look_interval(silence.seconds))
        kept_alive = CountingSilence(waiter, "g", [0, 1], 0.4, until=2 * silent_looks)

        def work() -> None:
            with worker.liveness.working("working on purpose"):
                kept_alive.looked_enough.wait(60)
            worker.client.set("done", "1")

        thread = threading.Thread(target=work)
        thread.start()
        assert wait_until(waiter, ["done"], kept_alive)
        thread.join()
        assert kept_alive.looked_enough.is_set()
        worker.client.add("ns/g/progress", ABORTED)
        worker.client.set("ns/g/abort", "group rank 1: gone")
        with self.assertRaisesRegex(
            CollectiveAutotuneError,
            "stopped on every rank of the group: group rank 1: gone",
        ):
            wait_until(waiter, ["never"], Silence(waiter, "g", [0, 1], 0.4))

    def test_a_session_is_joined_once_per_group_and_a_second_graph_reads_its_decision(
        self,
    ):
        store = dist.HashStore()
        member = _participant(store, 0, 0.4)
        decide = lambda joins: Decision(DecisionKind.COMPILE, "tune")  # noqa: E731
        fallback = lambda why: Decision(DecisionKind.FALLBACK, why)  # noqa: E731
        first = CollectiveSession(member, "g", "plan", 0, [0], 0.4).agree(
            Join("", {}), decide, fallback
        )
        requests = member.client.requests
        again = CollectiveSession(member, "g", "plan", 0, [0], 0.4).agree(
            Join("", {}), decide, fallback
        )
        assert (
            again == first and member.client.requests == requests
        )  # read from what it knows
        # The same plan on another group is another session: joined, decided there.
        other = CollectiveSession(member, "h", "plan", 0, [0], 0.4).agree(
            Join("", {}), decide, fallback
        )
        assert other == first and member.client.requests > requests
        # A session that ended in an error has no decision: a later graph says so at once
        # instead of waiting on the Store for one.
        member.client.add("ns/a/progress", ABORTED)
        member.client.set("ns/a/abort", "group rank 1: gone")
        with self.assertRaisesRegex(CollectiveAutotuneError, "group rank 1: gone"):
            CollectiveSession(member, "a", "plan", 0, [0, 1], 0.4).agree(
                Join("", {}), decide, fallback
            )
        requests = member.client.requests
        with self.assertRaisesRegex(
            CollectiveAutotuneError, "ended without a decision"
        ):
            CollectiveSession(member, "a", "plan", 0, [0, 1], 0.4).agree(
                Join("", {}), decide, fallback
            )
        assert member.client.requests - requests <= 1, (
            "it waited on the Store for a decision"
        )

    # -- how far a benchmark's readings can be trusted ---------------------------------

    def test_a_pick_is_settled_only_where_the_host_was_quiet(self):
        from torch._inductor.runtime.collective_benchmarking import (
            ChoiceStatus,
            ChoiceTiming,
        )
        from torch._inductor.runtime.collective_confidence import (
            CONTENTION_LIMIT,
            judge,
        )

        quiet, busy = CONTENTION_LIMIT / 2, CONTENTION_LIMIT * 2

        def timing(name, low, mid, high, contention=quiet):
            return ChoiceTiming(
                name,
                mid,
                mid,
                1,
                ChoiceStatus.OK,
                low_us=low,
                high_us=high,
                contention=contention,
            )

        def readings(contention):
            return [
                timing("a", 9.0, 10.0, 10.5, contention.get("a", quiet)),
                timing("b", 12.0, 13.0, 14.0, contention.get("b", quiet)),
                timing("c", 30, 31, 32, contention.get("c", quiet)),
            ]

        clear = readings({})
        settled = judge(clear, "a", host_paced=True)
        assert settled.settled and settled.runner_up == "b"
        assert abs(settled.lead - (12.0 / 10.5 - 1)) < 1e-9
        # The same readings with the host busy while the winner or the runner-up was
        # timed: not trusted where the host paced the samples (eager), trusted where it
        # did not (CUDA-graph replays).
        for loaded in ({"a": busy}, {"b": busy}):
            assert not judge(readings(loaded), "a", host_paced=True).settled
            assert "busy" in judge(readings(loaded), "a", host_paced=True).reason
            assert judge(readings(loaded), "a", host_paced=False).settled
        # Busy only while a choice that is neither was timed: it decides nothing.
        assert judge(readings({"c": busy}), "a", host_paced=True).settled
        # Overlapping quartiles on a quiet host: a near tie, kept (either serves as well).
        close = [timing("a", 9.0, 10.0, 11.0), timing("b", 10.5, 10.8, 12.0)]
        tie = judge(close, "a", host_paced=True)
        assert tie.settled and "near tie" in tie.reason and tie.lead < 0
        close[1] = dataclasses.replace(close[1], contention=busy)
        assert not judge(close, "a", host_paced=True).settled
        # Only one choice timed: nothing to be unsure about.
        assert judge([timing("a", 9, 10, 11, busy)], "a", host_paced=True).settled

    def test_collectives_are_recognised_by_their_exact_names_only(self):
        aten, fc = torch.ops.aten, torch.ops._c10d_functional
        for op in (
            fc.all_reduce.default,
            fc.all_reduce,
            "_c10d_functional::all_gather_into_tensor",
        ):
            assert is_collective_op(op), op
        assert is_collective_op(torch.ops.c10d.allreduce_.default)
        assert is_collective_op("torch.ops.symm_mem.one_shot_all_reduce.default")
        assert not is_collective_op(fc.wait_tensor.default)
        assert not is_collective_op(aten.broadcast_to.default)
        assert not is_collective_op(aten.broadcast_tensors.default)
        # Words of a collective in a user's op name say nothing of communication.
        for name in ("mylib::fused_all_reduce", "mylib.broadcast_weights.default"):
            assert not is_collective_op(name), name

    def test_an_op_named_like_a_collective_that_does_not_communicate_is_none(self):
        from torch._inductor.kernel.collective.detection import (
            collective_calls,
            names_a_collective,
        )

        op = torch.ops.cat_units.broadcast_weights.default
        assert not is_collective_op(op) and not names_a_collective(op)
        # Its implementation calls no collective: nothing makes it one.
        gm = torch.fx.experimental.proxy_tensor.make_fx(_broadcast_weights)(
            torch.ones(2, 3)
        )
        assert collective_calls(gm) == []
        # An implementation that calls a functional collective is one.
        calls = collective_calls(_all_reduce_graph())
        assert [n.target for n in calls] == [
            torch.ops._c10d_functional.all_reduce.default
        ]

    def test_identities_seen_at_compiles_go_with_inductors_caches_registered_ones_stay(
        self,
    ):
        from torch._inductor.kernel.collective import choices
        from torch._inductor.utils import clear_inductor_caches

        name, other = "cat_units::op/impl", "cat_units::op/other"
        choices._registered_identities[name] = "as registered"
        choices._identities.update({name: "at a compile", other: "at a compile"})
        try:
            assert choices.current_identity(name) == "at a compile"
            clear_inductor_caches()
            assert choices.current_identity(name) == "as registered"
            assert choices.current_identity(other) is None
        finally:
            choices._registered_identities.pop(name, None)

    def test_a_graph_calls_a_collective_where_an_op_communicates_or_names_a_group(self):
        from torch._inductor.kernel.collective.detection import collective_calls

        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        # torch's own op whose argument "group" is a count: no collective.
        norm = graph.call_function(
            torch.ops.aten.native_group_norm.default,
            (x, None, None, 1, 4, 2, 2, 1e-5),
        )
        # A custom op named like a collective, naming no group: none either.
        weights = graph.call_function(
            torch.ops.cat_units.broadcast_weights.default, (norm,)
        )
        graph.output(weights)
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        assert collective_calls(gm) == []


if __name__ == "__main__":
    run_tests()
