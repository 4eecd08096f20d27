# Owner(s): ["module: inductor"]
"""Unit tests of collective autotuning's size ladder: its walk, where it refines, which
choice each range runs, and the size dispatch's branches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from torch._inductor.kernel.collective.dispatch import _branches
from torch._inductor.kernel.collective.ladder import (
    _bisection_order,
    assign,
    branches,
    Incumbent,
    Ladder,
    next_size,
    Probe,
    roundest,
    TOLERANCE,
    walk,
)
from torch._inductor.kernel.collective.records import Measurement
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


SIZES = (1, 4, 16, 64, 256, 1024, 4096)
Cost = Callable[[str, int], float]


def linear_and_fixed(crossover: float) -> Cost:
    """Two choices crossing at ``crossover``: 1 µs per row, or a fixed cost."""
    return lambda choice, rows: {"linear": rows, "fixed": crossover}.get(choice, 1e9)


def measured(cost: Cost, choices: tuple[str, ...], probe: Probe) -> Measurement:
    """What the group decides at ``probe`` under ``cost``, as timing.pick does: the
    fastest, unless the incumbent is within the tolerance of it."""
    timed = probe.choices or choices
    us = {c: cost(c, probe.size) for c in timed}
    best = min(timed, key=us.__getitem__)
    kept = probe.incumbent.winner if probe.incumbent else None
    if kept in us and us[kept] <= us[best] * (1 + TOLERANCE):
        best = kept
    return Measurement(probe.size, best, us)


def walked(
    cost: Cost, choices: tuple[str, ...] = ("linear", "fixed", "default")
) -> tuple[list[tuple[float, str]], list[Probe]]:
    """The ranges a walk of SIZES gives under ``cost``, and the probes it timed."""
    probes: list[Probe] = []

    def measure(probe: Probe) -> Measurement:
        probes.append(probe)
        return measured(cost, choices, probe)

    measurements = walk(Ladder(None, "op", "x", 0, SIZES), measure)
    assert measurements is not None
    return branches(measurements, assign(measurements, TOLERANCE)), probes


def worst_loss(cost: Cost, ranges: list[tuple[float, str]], upto: int) -> float:
    """How much slower than the best choice any size up to ``upto`` runs."""
    worst = 0.0
    for n in range(1, upto + 1):
        runs = next(choice for top, choice in ranges if n <= top)
        best = min(cost(c, n) for c in ("linear", "fixed", "default"))
        worst = max(worst, cost(runs, n) / best - 1)
    return worst


@dataclasses.dataclass(frozen=True)
class _Bounds:
    start: int
    end: float


@dataclasses.dataclass
class _Group:
    impl_name: str
    ranges: list


class TestCollectiveOpTuningUnitsLadder(TestCase):
    def test_ladder_sizes_are_timed_coarse_to_fine_largest_first(self):
        self.assertEqual(_bisection_order(1), [0])
        self.assertEqual(_bisection_order(2), [1, 0])
        self.assertEqual(_bisection_order(8), [7, 0, 3, 1, 5, 2, 4, 6])
        for n in range(1, 20):
            self.assertEqual(sorted(_bisection_order(n)), list(range(n)))

    @parametrize("crossover", [2.5, 6, 40, 200, 1000, 3000])
    def test_a_crossover_between_ladder_sizes_is_found_within_the_tolerance(
        self, crossover
    ):
        ranges, probes = walked(linear_and_fixed(crossover))
        self.assertEqual([c for _, c in ranges], ["linear", "fixed"])
        self.assertLessEqual(
            worst_loss(linear_and_fixed(crossover), ranges, 4096), TOLERANCE
        )
        # Straight costs: a probe where their lines cross settles it (a second where
        # no whole size lies within the tolerance).
        between = [p for p in probes if p.choices is not None]
        self.assertIn(len(between), (1, 2), msg=str(between))
        self.assertEqual(between[0].choices, ("linear", "fixed"))
        self.assertEqual(between[0].incumbent.winner, "linear")

    def test_a_split_is_the_roundest_size_the_tolerance_allows(self):
        # 200 µs: the sizes 197-204 are within 2%, and 200 is their roundest.
        ranges, _ = walked(linear_and_fixed(200))
        self.assertEqual(ranges, [(200, "linear"), (math.inf, "fixed")])
        # Timings a little off move the lines, not the split.
        ranges, _ = walked(
            lambda c, n: linear_and_fixed(200)(c, n) * (1.003 if c == "fixed" else 1)
        )
        self.assertEqual(ranges[0], (200, "linear"))

    def test_a_step_in_the_costs_is_bisected_to_the_size(self):
        def step(choice: str, rows: int) -> float:
            return {"linear": 10 if rows <= 37 else 100, "fixed": 50}.get(choice, 1e9)

        ranges, probes = walked(step)
        self.assertEqual(ranges, [(37, "linear"), (math.inf, "fixed")])
        self.assertLessEqual(len([p for p in probes if p.choices]), 8)

    def test_a_near_tie_at_a_ladder_size_keeps_the_neighbours_choice(self):
        # At 256 linear is 0.8% slower than fixed: within the tolerance, the range of
        # 256 keeps linear, the choice below it, and nothing is timed in between.
        cost = linear_and_fixed(254)
        ranges, probes = walked(cost)
        self.assertEqual(ranges, [(256, "linear"), (math.inf, "fixed")])
        self.assertFalse([p for p in probes if p.choices], msg=str(probes))
        self.assertLessEqual(worst_loss(cost, ranges, 4096), TOLERANCE)

    def test_choices_that_timing_cannot_tell_apart_keep_the_choice_below(self):
        # Medians 10% apart, samples overlapping (host-paced timing at a few rows):
        # the range keeps the choice below, and nothing is probed between them.
        noisy = Measurement(
            16,
            "a",
            {"a": 11.0, "b": 10.0},
            low_us={"a": 8.0, "b": 7.0},
            high_us={"a": 14.0, "b": 13.0},
        )
        ms = [Measurement(4, "a", {"a": 5.0, "b": 9.0}), noisy]
        self.assertEqual(assign(ms, TOLERANCE), ["a", "a"])
        apart = Measurement(
            16, "b", {"a": 11.0, "b": 10.0}, low_us={"a": 10.9}, high_us={"b": 10.1}
        )
        self.assertEqual(assign([ms[0], apart], TOLERANCE), ["a", "b"])

    def test_a_range_keeps_the_choice_below_while_it_is_within_the_tolerance(self):
        ms = [
            Measurement(1, "a", {"a": 10.0, "b": 12.0}),
            Measurement(4, "b", {"a": 10.1, "b": 10.0}),  # a 1% behind: kept
            Measurement(16, "b", {"a": 13.0, "b": 10.0}),
            Measurement(64, "default", {}, measured=False),  # untimed: its winner
        ]
        self.assertEqual(assign(ms, TOLERANCE), ["a", "a", "b", "default"])

    def test_the_next_size_is_on_the_lines_else_the_middle(self):
        lo = Measurement(64, "linear", {"linear": 64.0, "fixed": 200.0})
        hi = Measurement(256, "fixed", {"linear": 256.0, "fixed": 200.0})
        self.assertEqual(next_size(lo, hi, ("linear", "fixed"), by_model=True), 200)
        self.assertEqual(next_size(lo, hi, ("linear", "fixed"), by_model=False), 128)
        untimed = Measurement(256, "fixed", {})
        self.assertEqual(next_size(lo, untimed, ("linear", "fixed"), True), 128)

    def test_roundest(self):
        self.assertEqual(roundest(196, 204), 200)
        self.assertEqual(roundest(980, 1020), 992)
        self.assertEqual(roundest(5, 7), 6)
        self.assertEqual(roundest(9, 9), 9)

    def test_a_probe_keeps_the_nearest_decided_winner_below_else_above(self):
        seen: list[Probe] = []

        def measure(probe: Probe) -> Measurement:
            seen.append(probe)
            return Measurement(probe.size, "x" if probe.size == 1 else "y", {})

        walk(Ladder(None, "op", "x", 0, (1, 4, 16, 64, 256)), measure)
        incumbents = {p.size: p.incumbent for p in seen}
        self.assertIsNone(incumbents[256])
        # The smallest size, timed after the largest, has only sizes above.
        self.assertEqual(incumbents[1], Incumbent("y", "256", between=False))
        self.assertEqual(incumbents[16], Incumbent("x", "1", between=False))
        # Between two that agree: only screened against their winner.
        self.assertEqual(incumbents[64], Incumbent("y", "16 and 256", between=True))

    def test_user_split_points_are_kept_as_given(self):
        ms: list[Probe] = []

        def measure(probe: Probe) -> Measurement:
            ms.append(probe)
            return measured(linear_and_fixed(200), ("linear", "fixed"), probe)

        result = walk(Ladder(None, "op", "x", 0, (64, 1024), refine=False), measure)
        self.assertEqual([m.size for m in result], [64, 1024])
        self.assertTrue(all(p.incumbent is None for p in ms))

    def test_dispatch_branches_follow_sizes_and_merge_neighbours_only(self):
        a = _Group("a", [_Bounds(1, 4), _Bounds(65, math.inf)])
        b = _Group("b", [_Bounds(5, 16), _Bounds(17, 64)])
        self.assertEqual(
            [(top, g.impl_name) for top, g in _branches([a, b])],
            [(4, "a"), (64, "b"), (math.inf, "a")],
        )


instantiate_parametrized_tests(TestCollectiveOpTuningUnitsLadder)


if __name__ == "__main__":
    run_tests()
