# Owner(s): ["module: inductor"]
"""Collective custom-op autotuning, end to end on real process groups.

Runs self-spawning under plain pytest (gloo on CPU; NCCL where GPUs are present) and
under ``torchrun --nproc_per_node=N -m pytest`` (tests for other world sizes skip).
Every case asserts the winner, the numbers, and that all ranks of a group agree.
"""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
import unittest


import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.kernel.custom_op import (
    CustomOpConfig,
    register_custom_op_autotuning,
)
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import collective_ops as ops
from collective_harness import (
    single_process,
    CollectiveTestCase,
    assert_all_ok,
    check,
    compile_and_check,
    Costs,
    DEVICE_CASES,
    Rank,
    REAL,
    run_ranks,
    short,
)


def check_agreement(results, n_ops: int, world_size: int) -> list:
    """Every rank made ``n_ops`` identical, benchmarked decisions; returns rank 0's."""
    per_rank = assert_all_ok(results)
    check.assertTrue(
        all(len(records) == n_ops for records in per_rank),
        msg=[len(r) for r in per_rank],
    )
    for records in per_rank[1:]:
        check.assertEqual(records, per_rank[0], msg="ranks disagree")
    for record in per_rank[0]:
        check.assertEqual(record.decision, "benchmark", msg=str(record))
        check.assertEqual(len(record.group_ranks), world_size)
        check.assertTrue(all(t.status == "ok" for t in record.timings), msg=record)
        check.assertTrue(
            all(0 < t.min_us <= t.max_us < math.inf for t in record.timings), msg=record
        )
        # The slowest rank's quartiles (each one the largest over the ranks) bracket its median.
        check.assertTrue(
            all(
                0 < t.low_us <= t.max_us <= t.high_us < math.inf for t in record.timings
            ),
            msg=record,
        )
        best = min(record.timings, key=lambda t: t.max_us)
        check.assertEqual(record.winner, best.name, msg=str(record))
    return per_rank[0]


# -- one all-reduce op ---------------------------------------------------------------


def one_op_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name

    def f(x):
        return ops.all_reduce(x, group) * 2 + 1

    return compile_and_check(f, torch.randn(64, 32, device=r.device))


# -- all-reduce, all-gather and reduce-scatter in one model -------------------------------


def three_collectives_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name

    # Each op's input is a graph input or a matmul's output: torch 2.11's custom-op
    # autotuning cannot take an unrealized (pointwise) input.
    def f(x, w):
        summed = ops.all_reduce(x, group)
        gathered = ops.all_gather(summed @ w, group)
        return ops.reduce_scatter(gathered @ w, group)

    return compile_and_check(
        f,
        torch.randn(16, 32, device=r.device),
        torch.randn(32, 32, device=r.device) / 8,
    )


# -- 4 ranks, 5 ops ------------------------------------------------------------------------


def five_ops_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name

    def f(x, y, w):
        a = ops.all_reduce(x, group)
        b = ops.all_gather(y, group)
        c = ops.reduce_scatter(b @ w, group)
        d = ops.all_reduce(a[:32] @ w, group)
        e = ops.all_reduce(c @ w, group)
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum()

    return compile_and_check(
        f,
        torch.randn(64, 16, device=r.device),
        torch.randn(8, 16, device=r.device),
        torch.randn(16, 16, device=r.device) / 4,
    )


# -- the slowest rank decides --------------------------------------------------------------


def slowest_rank_body(r: Rank, uneven_ms: str, even_ms: str, own_ms: str) -> list:
    # "uneven" is fast on average but slow on one rank; "even" is the same everywhere;
    # the op's own implementation waits own_ms.
    ops.register_all_reduce(
        ops.all_reduce_then("uneven", wait_ms=uneven_ms),
        ops.all_reduce_then("even", wait_ms=even_ms),
    )
    group = r.group.group_name
    with torch._inductor.config.patch(collective_benchmark_rounds=10):
        return compile_and_check(
            lambda x: ops.all_reduce(x, group, own_ms),
            torch.randn(8, 8, device=r.device),
        )


# -- two groups of 2 inside a world of 4 ---------------------------------------------------------


def two_groups_body(r: Rank) -> list:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[r.rank // 2]
    ops.register_all_reduce(ops.all_reduce_then("x"), ops.all_reduce_then("y"))
    return compile_and_check(
        lambda t: ops.all_reduce(t, mine.group_name), torch.randn(8, 8, device=r.device)
    )


# -- a non-collective custom op is tuned as before ----------------------------------------------


def _store_requests() -> int:
    """The Store requests collective autotuning made in this process so far."""
    from torch._inductor.runtime import collective_protocol

    member = collective_protocol._participant
    return member.client.requests if member is not None else 0


# Ops that communicate nothing: by name (none), and called with an argument named like
# a process group that is a count, or a string that names no group.
NON_COLLECTIVE_CALLS = {
    "no_group": lambda x: ops.scale(x) + 1,
    "group_count": lambda x: ops.grouped_scale(x, 4) + 1,
    "group_string_naming_none": lambda x: ops.layout_scale(x, "rows") + 1,
}


def non_collective_body(r: Rank, call: str) -> dict:
    from torch._inductor.runtime import collective_protocol
    from torch.distributed import _store_session

    ops.register_standard_ops()
    register_custom_op_autotuning(
        ops.grouped_scale,
        configs=[
            CustomOpConfig(ops.scaled_by_count),
            CustomOpConfig(ops.added_by_count),
        ],
    )
    register_custom_op_autotuning(
        ops.layout_scale,
        configs=[
            CustomOpConfig(ops.scaled_by_layout),
            CustomOpConfig(ops.added_by_layout),
        ],
    )
    counters.clear()
    before = _store_requests()
    # Under torchrun this process ran other tests' sessions first: count what this one adds.
    member = collective_protocol._participant
    joined_before, known_before = (
        (len(member.joined), len(member.known)) if member else (0, 0)
    )

    start = time.monotonic()
    records = compile_and_check(
        NON_COLLECTIVE_CALLS[call], torch.randn(32, 32, device=r.device)
    )
    elapsed = time.monotonic() - start
    member = collective_protocol._participant
    # A compile in a distributed job beats (a peer may wait in a session for this rank's
    # next graph): one "doing" write and one progress add per group each look, nothing else.
    looks = math.ceil(elapsed / _store_session.look_interval(member.client.timeout)) + 1
    per_look = 1 + len(_store_session.member_groups())
    return {
        "records": len(records),
        "sessions_joined": len(member.joined) - joined_before,
        "decisions_known": len(member.known) - known_before,
        "store_requests_within_heartbeats": _store_requests() - before
        <= per_look * looks,
        "autotuned": counters["inductor"]["select_algorithm_autotune"],
    }


def laid_out_all_reduce_body(r: Rank) -> None:
    """An op whose argument ``group`` names no process group ("rows") while its choices
    communicate (over WORLD): which group it means cannot be told."""
    register_custom_op_autotuning(
        ops.laid_out_all_reduce,
        configs=[CustomOpConfig(ops.laid_out_over_world)],
    )
    compile_and_check(
        lambda x: ops.laid_out_all_reduce(x, "rows"), torch.randn(8, 8, device=r.device)
    )


# -- where collective tuning does not apply ------------------------------------------------------


def single_rank_group_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name

    def f(x):
        return ops.all_reduce(x, group) * 2

    return compile_and_check(f, torch.randn(16, 16, device=r.device))


# -- a wrong-and-fast choice never wins -------------------------------------------------------


def wrong_and_fast_body(r: Rank) -> list:
    def skips_the_reduction(x, group_name, delay_ms="0"):
        return x * 1.0  # no communication at all: fastest, and wrong

    ops.register_all_reduce(ops.all_reduce_then("one_all_reduce"), skips_the_reduction)
    group = r.group.group_name
    return compile_and_check(
        lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
    )


def deterministic_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name
    with torch._inductor.config.patch(deterministic=True):
        return compile_and_check(
            lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
        )


# -- real models: pointwise inputs, choices that fail while traced, upstream's knobs -------------


def pointwise_input_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name

    # The most common tensor-parallel pattern: an activation before the reduction.
    def f(x, w):
        return x + ops.all_reduce(torch.relu(x @ w), group)

    return compile_and_check(
        f,
        torch.randn(16, 32, device=r.device),
        torch.randn(32, 32, device=r.device) / 8,
    )


def refused_when_traced_body(r: Rank, ranks: str) -> list:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        ops.refuses_when_traced("needs_capability", ranks),
        ops.reduce_scatter_all_gather,
    )
    group = r.group.group_name
    return compile_and_check(
        lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
    )


def threshold_body(r: Rank, threshold: float) -> list:
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    register_custom_op_autotuning(
        ops.all_reduce,
        configs=[CustomOpConfig(ops.all_reduce_then("faster"))],
        min_speedup_threshold=threshold,
    )
    group = r.group.group_name
    return compile_and_check(
        lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
    )


def cudagraph_registration_body(r: Rank) -> list:
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    register_custom_op_autotuning(
        ops.all_reduce,
        configs=[
            CustomOpConfig(ops.all_reduce_then("one_all_reduce")),
            CustomOpConfig(ops.chunked_all_reduce),
        ],
        benchmark_with_cudagraphs=True,
    )
    group = r.group.group_name
    return compile_and_check(
        lambda x: ops.all_reduce(x, group), torch.randn(64, 64, device=r.device)
    )


def switched_off_body(r: Rank) -> list:
    from torch._inductor import config

    with config.patch(collective_autotune=False):
        return one_op_body(r)


def switched_off_untraced_body(r: Rank) -> tuple[list, list]:
    """Three layers of a tuned all-reduce compiled with collective autotuning off, at a
    static and at a dynamic size: the records, and the traces of an implementation."""
    from torch._inductor import config
    from torch._inductor.kernel.collective.api import collective_autotune_records

    ops.register_all_reduce(ops.flat_cost, ops.per_row_cost, ops.opaque)
    ops.traced_at.clear()
    group = r.group.group_name

    def f(x):
        for _ in range(3):
            x = x + ops.all_reduce(torch.relu(x), group)
        return x

    start = len(collective_autotune_records())
    with config.patch(collective_autotune=False):
        records = compile_and_check(f, torch.randn(8, 4, device=r.device))
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        dynamic = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
        for rows in (5, 9, 17):
            x = torch.randn(rows, 4, device=r.device)
            torch.testing.assert_close(dynamic(x), f(x), rtol=1e-4, atol=1e-4)
    check.assertEqual(len(records), 3, msg=str(records))
    # One compile for every size: the op's own implementation keeps them symbolic.
    check.assertEqual(counter.frame_count, 1, msg=str(counter.frame_count))
    return collective_autotune_records()[start:], ops.traced_at.get("per_row_cost", [])


def labelled_body(r: Rank) -> str:
    import logging

    from torch._inductor.kernel.collective.api import format_record
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    def chunked(x, group_name, delay_ms="0", chunks=2):
        return torch.cat(
            [
                ops.fc.wait_tensor(ops.fc.all_reduce(c, "sum", group_name))
                for c in x.chunk(chunks)
            ]
        )

    # Upstream passes the first config's arguments to the op's own implementation, so
    # the first config sets none.
    register_custom_op_autotuning(
        ops.all_reduce,
        configs=[
            CustomOpConfig(ops.all_reduce_then("one_all_reduce")),
            CustomOpConfig(chunked, chunks=2),
            CustomOpConfig(chunked, chunks=4),
        ],
    )
    group = r.group.group_name
    logger = logging.getLogger("torch._inductor.kernel.collective.hooks")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        (record,) = compile_and_check(
            lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
        )
    finally:
        logger.removeHandler(handler)
    return format_record(record) + "\n" + "\n".join(lines)


# -- the device of the op's tensors ----------------------------------------------------------


def other_current_device_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name
    x = torch.randn(64, 32, device=r.device)  # on this rank's own GPU
    # A program that places its tensors without making their device current.
    torch.cuda.set_device((r.device.index + 1) % torch.cuda.device_count())
    try:
        return compile_and_check(lambda t: ops.all_reduce(t, group), x)
    finally:
        torch.cuda.set_device(r.device)


# -- Inductor's own accounting ------------------------------------------------------------------


def accounted_body(r: Rank) -> dict:
    from torch._dynamo.utils import compilation_time_metrics

    ops.register_standard_ops()
    (record,) = compile_and_check(
        lambda x: ops.all_reduce(x, r.group.group_name) + 1, torch.randn(8, 8)
    )
    return {
        "record": record,
        "timed": [
            k for k in compilation_time_metrics if k.endswith("_collective_autotuning")
        ],
    }


class TestCollectiveOpTuning(CollectiveTestCase):
    @parametrize("device", DEVICE_CASES)
    @parametrize("world_size", [2, 4])
    def test_one_all_reduce_op(self, world_size, device):
        (record,) = check_agreement(
            run_ranks(world_size, one_op_body, device=device), 1, world_size
        )
        # the three registered implementations and the op's own, by readable names
        self.assertEqual(
            {t.name for t in record.timings},
            {
                "chunked_all_reduce",
                "one_all_reduce",
                "reduce_scatter_all_gather",
                "default",
            },
        )
        self.assertEqual(record.mode, "eager")  # the model runs without CUDA graphs

    @parametrize("device", DEVICE_CASES)
    @parametrize("world_size", [2, 4])
    def test_model_with_all_reduce_all_gather_reduce_scatter(self, world_size, device):
        records = check_agreement(
            run_ranks(world_size, three_collectives_body, device=device), 3, world_size
        )
        self.assertEqual(
            [r.op for r in records],
            [
                "cat_test::all_reduce_autotuned",
                "cat_test::all_gather_autotuned",
                "cat_test::reduce_scatter_autotuned",
            ],
        )

    @parametrize("device", DEVICE_CASES)
    def test_four_ranks_five_ops(self, device):
        records = check_agreement(run_ranks(4, five_ops_body, device=device), 5, 4)
        # One session for the graph: five keys, each agreed and benchmarked in it.
        self.assertEqual(len({r.session for r in records}), 1)
        self.assertEqual(len({r.key for r in records}), 5)

    @parametrize("world_size", [2, 4])
    def test_slowest_rank_rule(self, world_size):
        # "uneven" costs 18 us on rank 0 and 1 elsewhere, "even" 10 everywhere: by the
        # average over the ranks "uneven" is faster, by the slowest rank "even" is.
        costs = Costs({"uneven": (18.0, 1.0), "even": 10.0})
        (record,) = check_agreement(
            run_ranks(world_size, slowest_rank_body, "0", "0", "0", timing=costs),
            1,
            world_size,
        )
        timing = {short(t.name): t for t in record.timings}
        self.assertEqual(timing["uneven"].max_us, 18.0, atol=0, rtol=0)
        self.assertEqual(timing["uneven"].min_us, 1.0, atol=0, rtol=0)
        self.assertEqual(timing["even"].max_us, timing["even"].min_us, atol=0, rtol=0)
        self.assertEqual(timing["even"].min_us, 10.0, atol=0, rtol=0)
        self.assertEqual(short(record.winner), "even")

    @parametrize("device", DEVICE_CASES)
    def test_the_slowest_ranks_real_time_decides(self, device):
        # Timed for real: "uneven" sleeps 50 ms a call on rank 0 alone, "even" 10 ms on
        # every rank, the op's own 60 ms: 5x and 6x apart on their slowest ranks.
        (record,) = check_agreement(
            run_ranks(
                2, slowest_rank_body, "50,0", "10", "60", device=device, timing=REAL
            ),
            1,
            2,
        )
        timing = {short(t.name): t for t in record.timings}
        self.assertGreaterEqual(timing["uneven"].max_us, 0.9 * 50e3)
        self.assertGreaterEqual(timing["even"].max_us, 9e3)
        self.assertEqual(short(record.winner), "even")

    @single_process
    def test_the_pick_compares_slowest_ranks(self):
        # A pure function of the group's timings (identical on every rank): the choice
        # fastest on its fastest rank, and on average, loses to the one fastest on its
        # slowest rank.
        from torch._inductor.kernel.collective.timing import pick
        from torch._inductor.runtime.collective_benchmarking import ChoiceTiming

        timings = [
            ChoiceTiming("uneven", 12_000.0, 1_000.0, 1, "ok"),
            ChoiceTiming("even", 6_000.0, 5_500.0, 1, "ok"),
        ]
        self.assertEqual(pick(["uneven", "even"], timings, 1.0, None)[0], "even")

    @parametrize("device", DEVICE_CASES)
    def test_two_groups_in_a_world_of_four_tune_independently(self, device):
        # Group [0, 1] finds "x" slow, group [2, 3] finds "y" slow.
        costs = Costs({"x": (60.0, 60.0, 10.0), "y": (10.0, 10.0, 60.0)})
        per_rank = assert_all_ok(
            run_ranks(4, two_groups_body, device=device, timing=costs)
        )
        (a0,), (a1,), (b0,), (b1,) = per_rank
        self.assertEqual(a0, a1)
        self.assertEqual(b0, b1)
        self.assertEqual(a0.group_ranks, (0, 1))
        self.assertEqual(b0.group_ranks, (2, 3))
        self.assertEqual(short(a0.winner), "y")
        self.assertEqual(short(b0.winner), "x")

    @parametrize("call", list(NON_COLLECTIVE_CALLS))
    @parametrize("device", DEVICE_CASES)
    def test_non_collective_op_is_tuned_as_before(self, device, call):
        # Tuned by upstream on each rank alone, whatever its arguments are named.
        per_rank = assert_all_ok(
            run_ranks(
                2,
                non_collective_body,
                call,
                device=device,
                env={"TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}")},
            )
        )
        for result in per_rank:
            self.assertEqual(
                result,
                {
                    "records": 0,
                    "sessions_joined": 0,
                    "decisions_known": 0,
                    "store_requests_within_heartbeats": True,
                    "autotuned": 1,
                },
            )

    def test_a_string_naming_no_group_where_the_choices_communicate_fails_naming_it(
        self,
    ):
        for result in run_ranks(2, laid_out_all_reduce_body):
            self.assertIsNotNone(result.error, msg=result)
            self.assertIn(
                "cat_test::laid_out_all_reduce communicates, but its argument "
                "group='rows' names no process group this rank knows",
                result.error,
            )

    def test_group_of_one_rank_is_timed_without_waiting_for_peers(self):
        # Inductor's regular benchmarking deadlocks on gloo collectives while lowering
        # (the Python dispatcher reaches gloo's worker thread), so even a group of one
        # goes through the collective benchmarker: a session of one rank.
        (record,) = check_agreement(run_ranks(1, single_rank_group_body), 1, 1)
        self.assertEqual(record.group_ranks, (0,))

    @single_process
    def test_without_torch_distributed_detection_warns_once_and_declines(self):
        from torch._inductor.kernel.collective.hooks import detect_collective
        from torch.fx.experimental.proxy_tensor import make_fx

        self.assertFalse(dist.is_initialized())
        impl = ops.all_reduce_then("one_all_reduce")
        gm = make_fx(impl, tracing_mode="fake")(torch.randn(4, 4), "0", "0")

        class Choice:  # what detection reads of a ChoiceCaller: its graph
            pass

        choice = Choice()
        choice.gm = gm
        with self.assertLogs(
            "torch._inductor.kernel.collective.hooks", logging.WARNING
        ) as caught:
            for _ in range(3):
                self.assertEqual(
                    detect_collective(
                        "all_reduce_autotuned",
                        [choice],
                        torch.ops.cat_test.all_reduce.default,
                        [{}],
                    ),
                    ([choice], False, None),
                )
        warnings = [r for r in caught.records if "not initialised" in r.getMessage()]
        self.assertEqual(len(warnings), 1)

    @parametrize("device", DEVICE_CASES)
    def test_wrong_and_fast_choice_is_rejected_on_every_rank(self, device):
        per_rank = assert_all_ok(run_ranks(2, wrong_and_fast_body, device=device))
        (record,), (other,) = per_rank
        self.assertEqual(record, other)
        status = {short(t.name): t.reason for t in record.timings}
        self.assertIn(
            "rejected: output differs from the reference", status["skips_the_reduction"]
        )
        self.assertNotEqual(short(record.winner), "skips_the_reduction")

    def test_deterministic_mode_agrees_on_the_op_itself_untimed(self):
        (a,), (b,) = assert_all_ok(run_ranks(2, deterministic_body))
        self.assertEqual(a, b)
        self.assertEqual(a.decision, "use")
        self.assertEqual(a.timings, ())
        self.assertEqual(short(a.winner), "default")
        self.assertIn("deterministic", a.reason)

    @parametrize("device", DEVICE_CASES)
    def test_op_whose_input_is_a_fused_pointwise_expression(self, device):
        (record,) = check_agreement(
            run_ranks(2, pointwise_input_body, device=device), 1, 2
        )
        self.assertEqual(len(record.timings), 4)

    @parametrize("device", DEVICE_CASES)
    @parametrize("ranks", ["1", "all"])
    def test_choice_raising_while_traced_is_dropped_on_every_rank(self, ranks, device):
        (a,), (b,) = assert_all_ok(
            run_ranks(2, refused_when_traced_body, ranks, device=device)
        )
        self.assertEqual(a, b)
        self.assertEqual(a.decision, "benchmark")
        self.assertEqual(
            {t.name for t in a.timings},
            {
                "one_all_reduce",
                "reduce_scatter_all_gather",
                "default",
            },
        )
        # The reason names the choice, the rank and what it raised.
        self.assertIn("needs_capability", a.reason)
        self.assertIn("group rank 1", a.reason)
        self.assertIn("NotImplementedError", a.reason)

    @parametrize(
        "threshold,expected",
        [(1.2, "faster"), (8.0, "default")],
        name_fn=lambda threshold, expected: f"{expected}_wins",
    )
    def test_min_speedup_threshold_compares_slowest_ranks(self, threshold, expected):
        import inspect

        from torch._inductor.kernel.custom_op import register_custom_op_autotuning

        if (
            "min_speedup_threshold"
            not in inspect.signature(register_custom_op_autotuning).parameters
        ):
            self.skipTest("this torch has no min_speedup_threshold")
        # The op's own costs 12 ms, "faster" 2 ms: 6x faster on every rank.
        costs = Costs({"faster": 2000.0}, own_us=12000.0)
        (a,), (b,) = assert_all_ok(
            run_ranks(2, threshold_body, threshold, timing=costs)
        )
        self.assertEqual(a, b, msg=str((a, b)))
        self.assertEqual(a.decision, "benchmark", msg=str((a, b)))
        self.assertEqual(a.winner, expected, msg=str((a, b)))
        if expected == "default":
            self.assertIn("min_speedup_threshold=8", a.reason, msg=a.reason)

    @parametrize("device", DEVICE_CASES)
    def test_benchmark_with_cudagraphs_times_in_graph_mode(self, device):
        import inspect

        from torch._inductor.kernel.custom_op import register_custom_op_autotuning

        if (
            "benchmark_with_cudagraphs"
            not in inspect.signature(register_custom_op_autotuning).parameters
        ):
            self.skipTest("this torch has no benchmark_with_cudagraphs")
        (a,), (b,) = assert_all_ok(
            run_ranks(2, cudagraph_registration_body, device=device)
        )
        self.assertEqual(a, b)
        self.assertEqual(a.decision, "benchmark")
        # CUDA graphs need CUDA: on the CPU the choices are timed eagerly, as the model runs.
        self.assertEqual(a.mode, "graph" if device == "cuda" else "eager")

    @parametrize("device", DEVICE_CASES)
    def test_collective_autotuning_switched_off(self, device):
        (record,), (other,) = assert_all_ok(
            run_ranks(2, switched_off_body, device=device)
        )
        self.assertEqual(record, other)
        self.assertEqual(record.winner, "default")
        self.assertEqual(record.decision, "use")
        self.assertIn("TORCHINDUCTOR_COLLECTIVE_AUTOTUNE=0", record.reason)
        self.assertEqual(record.session, "")
        self.assertEqual(record.timings, ())  # no session at all

    @parametrize("device", DEVICE_CASES)
    def test_switched_off_traces_no_implementation(self, device):
        # The op's own implementation runs on every rank: tracing the others at every
        # call site would only make the compile slower than an untuned op's.
        for records, traced in assert_all_ok(
            run_ranks(2, switched_off_untraced_body, device=device)
        ):
            self.assertEqual(traced, [], msg=str(traced))
            # One per call site of each compile, the static one and the dynamic one.
            self.assertEqual(len(records), 6, msg=str(records))
            self.assertTrue(
                all(
                    r.winner == "default" and r.decision == "use" and r.session == ""
                    for r in records
                ),
                msg=records,
            )

    @single_process
    def test_switch_off_variable_sets_the_knob(self):
        import os

        env = {**os.environ, "TORCHINDUCTOR_COLLECTIVE_AUTOTUNE": "0"}
        code = "import torch._inductor.config as c; print(c.collective_autotune)"
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True
        )
        self.assertEqual(done.stdout.strip(), "False", msg=done.stderr)

    def test_tables_and_logs_name_choices_readably(self):
        text, _ = assert_all_ok(run_ranks(2, labelled_body))
        self.assertIn("chunked(chunks=2)", text)
        self.assertIn("chunked(chunks=4)", text)
        self.assertIn("default", text)
        self.assertIn("its quartiles us", text)  # what "clearly faster" compares
        self.assertNotIn("_autotuned_", text)
        self.assertNotIn("group_name", text)

    @unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")
    def test_benchmarks_on_the_cuda_device_of_the_ops_tensors_not_the_current_one(self):
        check_agreement(run_ranks(2, other_current_device_body, device="cuda"), 1, 2)

    @single_process
    def test_benchmark_device_is_the_ops_own(self):
        from torch._inductor.runtime.collective_benchmarking import benchmark_device

        # An explicit index is kept whatever device is current; CPU stays CPU.
        self.assertEqual(
            benchmark_device(torch.device("cuda", 1)), torch.device("cuda", 1)
        )
        self.assertEqual(benchmark_device(torch.device("cpu")), torch.device("cpu"))

    def test_each_decision_is_in_compile_metrics_and_a_tlparse_artifact(self):
        trace = self.tmp_path / "trace"
        a, b = assert_all_ok(
            run_ranks(
                2, accounted_body, env={"TORCH_TRACE": str(trace)}, fresh_processes=True
            )
        )
        # dynamo_timed: counted in compile_time_autotune_time_us with Inductor's own tuning.
        self.assertEqual(a["timed"], b["timed"])
        self.assertEqual(
            b["timed"], ["cat_test::all_reduce_autotuned_collective_autotuning"]
        )
        # One artifact per decision in each rank's TORCH_TRACE log, as tlparse reads it.
        logs = sorted(trace.glob("*.log"))
        self.assertEqual(len(logs), 2, msg=str(logs))
        for log in logs:
            artifacts = [
                json.loads(line[line.index("] ") + 2 :])
                for line in log.read_text().splitlines()
                if '"collective_autotuning"' in line and line.startswith("V")
            ]
            self.assertEqual(len(artifacts), 1)
            self.assertEqual(artifacts[0]["artifact"]["name"], "collective_autotuning")
        self.assertIn(a["record"].key, "".join(log.read_text() for log in logs))


instantiate_parametrized_tests(TestCollectiveOpTuning)


if __name__ == "__main__":
    run_tests()
