# Owner(s): ["module: inductor"]
"""Unit tests of collective benchmarking: sampling, verdicts, settings, confidence."""

from __future__ import annotations

import dataclasses
import math

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
    prune,
    SlowestRankQuartiles,
    Verdict,
)
from torch.testing._internal.common_utils import run_tests, TestCase


class TestCollectiveOpTuningUnitsBenchmarking(TestCase):
    # -- sampling ----------------------------------------------------------------------

    def test_a_screen_stops_once_no_choice_is_clearly_faster_than_the_incumbent(self):
        candidates = [Candidate(n, lambda: None) for n in ("a", "b", "c")]

        def stops(low, high, incumbent, rounds=3):
            mid = [(lo + hi) / 2 for lo, hi in zip(low, high)]
            quartiles = SlowestRankQuartiles(low, mid, high, rounds)
            return prune([0, 1, 2], quartiles, set(), 3, candidates, incumbent)[1]

        # b leads a by less than the samples' spread: a, the incumbent, is unbeaten.
        overlapping = ([10.0, 9.5, 30.0], [10.4, 10.2, 31.0])
        self.assertTrue(stops(*overlapping, incumbent=0))
        # Without an incumbent the tie needs twice the rounds.
        self.assertFalse(stops(*overlapping, incumbent=None))
        # b and c clearly beat the incumbent and are close: sampling goes on.
        self.assertFalse(stops([10.0, 5.0, 5.05], [10.4, 5.2, 5.25], incumbent=0))

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
            SlowestRankQuartiles(low, mid, high, rounds=3),
            {3},
            min_rounds=3,
            candidates=candidates,
        )
        self.assertEqual(live, [0, 1, 3])
        self.assertFalse(settled)  # "slow" dropped; "kept" kept; a tie needs 6 rounds
        live, settled = prune(
            [0, 1, 3],
            SlowestRankQuartiles(low, mid, high, rounds=6),
            {3},
            min_rounds=3,
            candidates=candidates,
        )
        self.assertEqual(live, [0, 1, 3])
        self.assertTrue(settled)  # "close" within 2% of the leader

    def test_an_eager_sample_leads_in_for_a_fixed_time_not_a_fixed_count(self):
        # About _EAGER_LEAD_IN_US of untimed calls, whatever a call costs: many short
        # calls, a few long ones, none for a call longer than the lead-in; and never
        # more than a sample's most calls, nor any for a choice that was not timed.
        self.assertEqual(_lead_in_calls(_EAGER_LEAD_IN_US / 10), 10)
        self.assertEqual(_lead_in_calls(_EAGER_LEAD_IN_US / 2.5), 2)
        self.assertEqual(_lead_in_calls(_EAGER_LEAD_IN_US * 1.5), 0)
        self.assertEqual(_lead_in_calls(1e-6), _MAX_CALLS_PER_SAMPLE)
        self.assertEqual(_lead_in_calls(math.inf), 0)
        self.assertEqual(_lead_in_calls(0.0), 0)

    def test_a_captured_batch_holds_many_calls_unless_one_call_lasts_a_sample(self):
        # A call shorter than a sample keeps the floor, however long it read.
        self.assertEqual(_graph_calls(500.0, 10.0), 50)
        self.assertEqual(_graph_calls(500.0, 150.0), _MIN_GRAPH_CALLS)
        self.assertEqual(_graph_calls(500.0, 499.0), _MIN_GRAPH_CALLS)
        # A call as long as a sample: a few back to back time it (a first call that
        # paid once is captured again from its first replay's share, which reads short).
        self.assertEqual(_graph_calls(500.0, 500.0), _MIN_LONG_GRAPH_CALLS)
        self.assertEqual(_graph_calls(500.0, 924.0), _MIN_LONG_GRAPH_CALLS)
        self.assertLess(_MIN_LONG_GRAPH_CALLS, _MIN_GRAPH_CALLS)
        self.assertEqual(_graph_calls(500.0, math.inf), _MIN_GRAPH_CALLS)
        # Captured again from its first replay: the floor, as its rivals sized from
        # their eager first calls get at small sizes, never more calls than they.
        self.assertEqual(_recaptured_calls(500.0, 10.0), _MIN_GRAPH_CALLS)
        self.assertEqual(_recaptured_calls(500.0, 499.0), _MIN_GRAPH_CALLS)
        self.assertEqual(_recaptured_calls(500.0, 600.0), _MIN_LONG_GRAPH_CALLS)

    # -- verdicts and settings ---------------------------------------------------------

    def test_a_screen_status_reads_the_same_from_every_ranks_verdicts(self):
        ok, wrong = (
            [float(Verdict.OK), 0.0, 5.0],
            [float(Verdict.WRONG_OUTPUT), 7.95, 5.0],
        )
        self.assertIs(_status([ok, ok], "").status, ChoiceStatus.OK)
        self.assertEqual(
            _status([wrong, ok], ""),
            (
                ChoiceStatus.REJECTED,
                "rejected by group ranks [0] (group rank 0: rejected: output differs from the reference (max "
                "abs error 7.95)), accepted by group ranks [1]: a result that differs between ranks suggests it "
                "reads data before a collective completed",
            ),
        )
        wrote = [float(Verdict.WROTE_INPUT), 1.0, 5.0]
        self.assertIn(
            "writes into input 1, which the op does not declare it mutates",
            _status([wrote, wrote], "").reason,
        )
        raised = [float(Verdict.RAISED), 0.0, math.inf]
        self.assertEqual(
            _status([raised, raised], "raised on every rank: x"),
            (
                ChoiceStatus.RAISED,
                "raised on every rank: x",
            ),
        )

    def test_settings_are_validated_in_one_place(self):
        good = BenchmarkSettings(
            20, 5, 30.0, 1000.0, 500.0, "auto", True, 16384, 4, True, None
        )
        good.validate()
        with self.assertRaisesRegex(
            ValueError, "collective_benchmark_rounds=0: an int >= 1"
        ):
            dataclasses.replace(good, rounds=0).validate()
        with self.assertRaisesRegex(
            ValueError, "collective_autotune_dynamic_ratio=1: an int >= 2"
        ):
            dataclasses.replace(good, dynamic_ratio=1).validate()
        with self.assertRaisesRegex(
            ValueError, "collective_benchmark_timeout=-1: seconds, > 0"
        ):
            dataclasses.replace(good, timeout=-1).validate()
        dataclasses.replace(good, compile_range=(1, 64)).validate()
        with self.assertRaisesRegex(
            ValueError, r"collective_autotune_compile_range=\(64, 1\): None or"
        ):
            dataclasses.replace(good, compile_range=(64, 1)).validate()
        self.assertEqual(
            set(good.knobs()),
            {
                "collective_benchmark_rounds",
                "collective_benchmark_warmup",
                "collective_benchmark_timeout",
                "collective_benchmark_sample_us",
                "collective_benchmark_graph_sample_us",
                "collective_benchmark_mode",
                "collective_autotune_dynamic",
                "collective_autotune_dynamic_max",
                "collective_autotune_dynamic_ratio",
                "collective_autotune_range_graphs",
                "collective_autotune_compile_range",
            },
        )

    def test_upstreams_own_collective_benchmarking_is_replaced_not_left_behind(self):
        import inspect

        from torch._inductor import utils
        from torch._inductor.codegen.subgraph import SubgraphChoiceCaller
        from torch._inductor.select_algorithm import AlgorithmSelectorCache

        for gone in ("benchmark_collective_choice", "_run_collective_benchmark"):
            self.assertFalse(hasattr(AlgorithmSelectorCache, gone), msg=gone)
        self.assertFalse(hasattr(SubgraphChoiceCaller, "benchmark_collective"))
        self.assertFalse(hasattr(utils, "is_collective_op"))
        self.assertFalse(hasattr(utils, "COLLECTIVE_OPS"))
        # The flag routes a collective op at the entry point, and goes no further.
        self.assertIn(
            "is_collective",
            inspect.signature(AlgorithmSelectorCache.__call__).parameters,
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
            self.assertNotIn("is_collective", parameters, msg=method)

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
        self.assertTrue(settled.settled)
        self.assertEqual(settled.runner_up, "b")
        self.assertLess(abs(settled.lead - (12.0 / 10.5 - 1)), 1e-9)
        # The same readings with the host busy while the winner or the runner-up was
        # timed: not trusted where the host paced the samples (eager), trusted where it
        # did not (CUDA-graph replays).
        for loaded in ({"a": busy}, {"b": busy}):
            self.assertFalse(judge(readings(loaded), "a", host_paced=True).settled)
            self.assertIn("busy", judge(readings(loaded), "a", host_paced=True).reason)
            self.assertTrue(judge(readings(loaded), "a", host_paced=False).settled)
        # Busy only while a choice that is neither was timed: it decides nothing.
        self.assertTrue(judge(readings({"c": busy}), "a", host_paced=True).settled)
        # Overlapping quartiles on a quiet host: a near tie, kept (either serves as well).
        close = [timing("a", 9.0, 10.0, 11.0), timing("b", 10.5, 10.8, 12.0)]
        tie = judge(close, "a", host_paced=True)
        self.assertTrue(tie.settled)
        self.assertIn("near tie", tie.reason)
        self.assertLess(tie.lead, 0)
        close[1] = dataclasses.replace(close[1], contention=busy)
        self.assertFalse(judge(close, "a", host_paced=True).settled)
        # Only one choice timed: nothing to be unsure about.
        self.assertTrue(
            judge([timing("a", 9, 10, 11, busy)], "a", host_paced=True).settled
        )


if __name__ == "__main__":
    run_tests()
