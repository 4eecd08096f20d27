# Owner(s): ["module: inductor"]
"""Unit tests of collective choices: tracing, timing as traced, identity, detection."""

from __future__ import annotations

import unittest

import torch

from torch._inductor.kernel.collective.choice_modules import (
    costs_alike_uncompiled,
    eager_module,
    Neighbours,
    only_calls_opaque_ops,
)
from torch._inductor.kernel.collective.choices import code_identity, unwaited_collective
from torch._inductor.kernel.collective.detection import is_collective_op
from torch._inductor.runtime.collective_benchmarking import TimingMode
from torch.testing._internal.common_utils import run_tests, TestCase


# -- graphs and implementations to trace -----------------------------------------------


def _targets(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


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


# -- an op named like a collective that does not communicate ---------------------------


@torch.library.custom_op("cat_units::broadcast_weights", mutates_args=())
def _broadcast_weights(x: torch.Tensor) -> torch.Tensor:
    """Broadcasts a tensor's rows along its columns: no communication, whatever its name."""
    return x.sum(dim=1, keepdim=True).expand_as(x).clone()


@_broadcast_weights.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class TestCollectiveOpTuningUnitsChoices(TestCase):
    # -- tracing and timing as traced --------------------------------------------------

    def test_reading_a_collectives_output_before_waiting_is_found(self):
        fc = torch.ops._c10d_functional

        def early(x):
            out = fc.all_reduce(x, "sum", "0")
            return out * 2  # before wait_tensor

        def waited(x):
            return fc.wait_tensor(fc.all_reduce(x, "sum", "0")) * 2

        from torch.fx.experimental.proxy_tensor import make_fx

        x = torch.randn(4)
        self.assertIn(
            "reads the output of _c10d_functional::all_reduce before wait_tensor",
            unwaited_collective(make_fx(early, tracing_mode="fake")(x)),
        )
        self.assertEqual(
            unwaited_collective(make_fx(waited, tracing_mode="fake")(x)), ""
        )

    def test_only_a_graph_of_ops_inductor_calls_as_they_are_is_timed_uncompiled(self):
        import collective_ops as ops
        from torch.fx.experimental.proxy_tensor import make_fx

        fc = torch.ops._c10d_functional

        def traced(fn):
            return make_fx(fn, tracing_mode="fake")(torch.randn(4, 2))

        # An opaque op, alone or twice (nothing between them to fuse).
        self.assertTrue(
            only_calls_opaque_ops(traced(lambda x: ops.opaque_all_reduce(x, "0")))
        )
        self.assertTrue(
            only_calls_opaque_ops(
                traced(lambda x: ops.opaque_all_reduce(ops.scale(x), "0"))
            )
        )
        # Inductor lowers functional collectives (the input's copy fuses with its
        # producer), pointwise ops, and an opaque op beside either.
        self.assertFalse(
            only_calls_opaque_ops(
                traced(lambda x: fc.wait_tensor(fc.all_reduce(x, "sum", "0")))
            )
        )
        self.assertFalse(
            only_calls_opaque_ops(traced(lambda x: ops.opaque_all_reduce(x, "0") + 1))
        )
        # Nothing called: nothing to time as called.
        self.assertFalse(only_calls_opaque_ops(traced(lambda x: x)))

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
        self.assertTrue(costs_alike_uncompiled(traced(lambda x: reduced(x)), fused))
        # The output of a kernel that only this op reads (a matmul's) is reduced in
        # place with no copy at all: its producer's stand-in is reduced in place too.
        owned = Neighbours(owned_input=True)
        self.assertTrue(costs_alike_uncompiled(traced(lambda x: reduced(x)), owned))
        # A graph input's copy is a Triton kernel where the op called copies with a
        # memcpy (so for an all_reduce_coalesced, a broadcast): compiled.
        self.assertFalse(costs_alike_uncompiled(traced(lambda x: reduced(x)), alone))
        coalesced = traced(
            lambda x: fc.wait_tensor(fc.all_reduce_coalesced([x], "sum", "0")[0])
        )
        broadcast = traced(lambda x: fc.wait_tensor(fc.broadcast(x, 0, "0")))
        for graph in (coalesced, broadcast):
            self.assertFalse(costs_alike_uncompiled(graph, alone))
            self.assertFalse(costs_alike_uncompiled(graph, fused))
        # A collective that takes its input as it is: alike without a producer, but a
        # produced input that goes elsewhere than its one all-reduce is the compile's
        # (where the producer's result lives is the compile's to say).
        gathered = traced(
            lambda x: ops.opaque_all_reduce(
                fc.wait_tensor(fc.all_gather_into_tensor(x, 2, "0")), "0"
            )
        )
        self.assertTrue(costs_alike_uncompiled(gathered, alone))
        self.assertFalse(costs_alike_uncompiled(gathered, fused))
        both = traced(lambda x: (ops.opaque_all_reduce(x, "0"), reduced(x)))
        self.assertFalse(costs_alike_uncompiled(both, fused))
        # An all-reduce of a value the graph computes, which Inductor may reduce in
        # place without a copy, and Inductor's own pointwise ops: compiled.
        self.assertFalse(
            costs_alike_uncompiled(
                traced(lambda x: reduced(ops.opaque_all_reduce(x, "0"))), alone
            )
        )
        self.assertFalse(
            costs_alike_uncompiled(traced(lambda x: reduced(x * 2)), alone)
        )
        self.assertFalse(costs_alike_uncompiled(traced(lambda x: x), alone))

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
                self.assertIn(called, calls.names, msg=calls.names)

    def test_an_owned_inputs_producer_runs_before_a_compiled_choice_never_fused(self):
        import types

        from torch._inductor.kernel.collective.choice_modules import AfterOwnedInput

        owned = Neighbours(owned_input=True, consumer=True)
        # Part of the key; compiled with the consumer only (nothing fuses with the
        # kernel computing the input in the model, a matmul, say).
        self.assertEqual(str(owned), "owned-input+consumer")
        self.assertEqual(owned.fused, Neighbours(consumer=True))
        self.assertEqual(Neighbours(producer=True).fused, Neighbours(producer=True))
        called = []
        module = types.SimpleNamespace(call=lambda args: called.append(args) or [0])
        x, y = torch.randn(3), torch.randn(3)
        # The stand-in negates the first tensor, after the symbolic sizes, each call.
        AfterOwnedInput(module, sym_inputs=1).call([7, x, y])
        ((size, first, second),) = called
        self.assertEqual(size, 7)
        self.assertIs(second, y)
        torch.testing.assert_close(first, -x)

    def test_an_inlined_graph_is_left_alone_while_collective_autotuning_is_off(self):
        from unittest import mock

        from torch._inductor import config
        from torch._inductor.kernel.collective import choice_modules

        # A choice that all-reduces its first input: patch 0009's hook asks whether the
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
                self.assertIs(choice_modules.to_inline(gm, ["site"]), gm)
            self.assertEqual(asked, [])
            with config.patch(collective_autotune=True):
                self.assertIs(choice_modules.to_inline(gm, ["site"]), gm)  # not owned
            self.assertEqual(asked, [["site"]])

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
            self.assertEqual(
                timed_as_traced(alike, gpu, fused, mode), {"opaque", "functional"}
            )
            # On a CPU every subgraph choice runs as traced.
            self.assertEqual(
                timed_as_traced(mixed, cpu, fused, mode),
                {
                    "opaque",
                    "functional",
                    "pointwise",
                },
            )
        # A choice with pointwise work of its own is compiled; in graph mode the others
        # are still timed as traced (a replay costs the device's work), in the default
        # mode they are compiled too, to launch from the host as that one does.
        self.assertEqual(
            timed_as_traced(mixed, gpu, fused, TimingMode.GRAPH),
            {
                "opaque",
                "functional",
            },
        )
        self.assertEqual(timed_as_traced(mixed, gpu, fused, TimingMode.EAGER), set())

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
            self.assertNotEqual(unwaited_collective(unwaited), "", msg=fn.__name__)
            gm = make_fx(with_waits(fn, None), tracing_mode="fake")(x)
            self.assertEqual(
                _targets(gm), expected, msg=str((fn.__name__, _targets(gm)))
            )
            self.assertEqual(unwaited_collective(gm), "", msg=fn.__name__)

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
        self.assertEqual(waited.code, plain.code)

    @unittest.skipUnless(
        hasattr(torch.ops._c10d_functional, "wait_tensors"), "torch 2.15 on"
    )
    def test_a_list_waited_for_with_wait_tensors_is_traced_as_written(self):
        from torch._inductor.kernel.collective.waits import with_waits
        from torch.fx.experimental.proxy_tensor import make_fx

        fc = torch.ops._c10d_functional

        def coalesced(x, y):  # waits for both outputs at once, as funcol traces it
            a, b = fc.wait_tensors(fc.all_reduce_coalesced([x, y], "sum", "0"))
            return a + b

        args = (torch.randn(4), torch.randn(4))
        plain = make_fx(coalesced, tracing_mode="fake")(*args)
        waited = make_fx(with_waits(coalesced, None), tracing_mode="fake")(*args)
        self.assertEqual(waited.code, plain.code)

    # -- code identity -----------------------------------------------------------------

    def test_code_identity_follows_the_code_not_the_name(self):
        self.assertEqual(code_identity(_factory(2.0)), code_identity(_factory(2.0)))
        # A value closed over.
        self.assertNotEqual(code_identity(_factory(2.0)), code_identity(_factory(3.0)))
        self.assertNotEqual(
            code_identity(_factory(2.0, lambda y: y + 1)),
            code_identity(_factory(2.0, lambda y: y - 1)),
        )

        def a(x):
            return x + 1

        def b(x):
            return x + 2

        b.__name__ = b.__qualname__ = a.__qualname__
        self.assertNotEqual(code_identity(a), code_identity(b))  # same name, other code

    def test_identities_seen_at_compiles_go_with_inductors_caches_registered_ones_stay(
        self,
    ):
        from torch._inductor.kernel.collective import choices
        from torch._inductor.utils import clear_inductor_caches

        name, other = "cat_units::op/impl", "cat_units::op/other"
        choices._registered_identities[name] = "as registered"
        choices._identities.update({name: "at a compile", other: "at a compile"})
        try:
            self.assertEqual(choices.current_identity(name), "at a compile")
            clear_inductor_caches()
            self.assertEqual(choices.current_identity(name), "as registered")
            self.assertIsNone(choices.current_identity(other))
        finally:
            choices._registered_identities.pop(name, None)

    # -- exact collective detection ----------------------------------------------------

    def test_collectives_are_recognised_by_their_exact_names_only(self):
        aten, fc = torch.ops.aten, torch.ops._c10d_functional
        for op in (
            fc.all_reduce.default,
            fc.all_reduce,
            "_c10d_functional::all_gather_into_tensor",
        ):
            self.assertTrue(is_collective_op(op), msg=op)
        self.assertTrue(is_collective_op(torch.ops.c10d.allreduce_.default))
        self.assertTrue(
            is_collective_op("torch.ops.symm_mem.one_shot_all_reduce.default")
        )
        self.assertFalse(is_collective_op(fc.wait_tensor.default))
        self.assertFalse(is_collective_op(aten.broadcast_to.default))
        self.assertFalse(is_collective_op(aten.broadcast_tensors.default))
        # Words of a collective in a user's op name say nothing of communication.
        for name in ("mylib::fused_all_reduce", "mylib.broadcast_weights.default"):
            self.assertFalse(is_collective_op(name), msg=name)

    def test_an_op_named_like_a_collective_that_does_not_communicate_is_none(self):
        from torch._inductor.kernel.collective.detection import (
            collective_calls,
            may_communicate,
        )

        op = torch.ops.cat_units.broadcast_weights.default
        self.assertFalse(is_collective_op(op))
        self.assertFalse(may_communicate(op))
        # Its implementation calls no collective: nothing makes it one.
        gm = torch.fx.experimental.proxy_tensor.make_fx(_broadcast_weights)(
            torch.ones(2, 3)
        )
        self.assertEqual(collective_calls(gm), [])
        # An implementation that calls a functional collective is one.
        calls = collective_calls(_all_reduce_graph())
        self.assertEqual(
            [n.target for n in calls], [torch.ops._c10d_functional.all_reduce.default]
        )

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
        self.assertEqual(collective_calls(gm), [])


# Ops that take a process group by type, or an argument named "group" of another kind.
_GROUPS = torch.library.Library("cat_units_groups", "DEF")
_GROUPS.define(
    "by_type(Tensor x, __torch__.torch.classes.c10d.ProcessGroup pg) -> Tensor"
)
_GROUPS.define("by_count(Tensor x, int group) -> Tensor")
_GROUPS.define("by_string(Tensor x, str group) -> Tensor")


class TestGroupDetection(TestCase):
    def test_a_group_is_told_by_type_or_by_a_name_this_rank_knows(self):
        from torch._inductor.kernel.collective.detection import (
            call_names_a_group,
            may_communicate,
            named_groups,
        )

        ops = torch.ops.cat_units_groups
        # A ProcessGroup by type communicates, whatever the argument is named.
        self.assertTrue(may_communicate(ops.by_type.default))
        # A count named "group" never does.
        self.assertFalse(may_communicate(ops.by_count.default))
        self.assertEqual(named_groups(ops.by_count.default, {"group": 4}), [])
        # A string named "group" may: its value decides, and "rows" names no group.
        self.assertTrue(may_communicate(ops.by_string.default))
        (named,) = named_groups(ops.by_string.default, {"group": "rows"})
        self.assertEqual(
            (named.argument, named.value, named.group), ("group", "rows", None)
        )
        self.assertFalse(call_names_a_group(ops.by_string.default, {"group": "rows"}))


if __name__ == "__main__":
    run_tests()
