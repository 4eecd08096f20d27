# Owner(s): ["module: inductor"]
"""Unit tests of collective autotuning's size ladder and its size dispatch."""

from __future__ import annotations

import dataclasses
import math

from torch._inductor.kernel.collective.dispatch import (
    _bisection_order,
    _branches,
    incumbent,
    Incumbent,
)
from torch.testing._internal.common_utils import run_tests, TestCase


# -- the ladder ------------------------------------------------------------------------


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


class TestCollectiveOpTuningUnitsDispatch(TestCase):
    def test_ranges_are_tuned_coarse_to_fine_largest_first(self):
        self.assertEqual(_bisection_order(1), [0])
        self.assertEqual(_bisection_order(2), [1, 0])
        self.assertEqual(_bisection_order(8), [7, 0, 3, 1, 5, 2, 4, 6])
        for n in range(1, 20):
            self.assertEqual(sorted(_bisection_order(n)), list(range(n)))

    def test_a_range_keeps_the_nearest_decided_winner_below_else_above(self):
        self.assertIsNone(incumbent(LADDER, "op_range_1_1", {}.get))
        self.assertEqual(
            incumbent(LADDER, "op_range_5_16", {"op_range_2_4": "x"}.get),
            Incumbent("x", "4", between=False),
        )
        below_and_above = {"op_range_1_1": "x", "op_range_65_inf": "y"}.get
        self.assertEqual(
            incumbent(LADDER, "op_range_5_16", below_and_above),
            Incumbent("x", "1", between=False),
        )
        # The smallest range, timed after the largest, has only ranges above.
        self.assertEqual(
            incumbent(LADDER, "op_range_1_1", {"op_range_65_inf": "y"}.get),
            Incumbent("y", "inf", between=False),
        )

    def test_a_range_between_two_that_agree_is_screened_against_their_winner(self):
        agree = {"op_range_1_1": "a", "op_range_65_inf": "a"}.get
        self.assertEqual(
            incumbent(LADDER, "op_range_5_16", agree),
            Incumbent("a", "1 and inf", between=True),
        )
        # The nearest decided neighbours count, not the farthest.
        nearest = {"op_range_1_1": "a", "op_range_2_4": "b", "op_range_65_inf": "b"}.get
        self.assertEqual(
            incumbent(LADDER, "op_range_5_16", nearest),
            Incumbent("b", "4 and inf", between=True),
        )

    def test_dispatch_branches_follow_sizes_and_merge_neighbours_only(self):
        a = _Group("a", [_Bounds(1, 4), _Bounds(65, math.inf)])
        b = _Group("b", [_Bounds(5, 16), _Bounds(17, 64)])
        branches = _branches([a, b])
        # a up to 4, b up to 64 (two neighbouring ranges merged), a again above.
        self.assertEqual(
            [(top, g.impl_name) for top, g in branches],
            [
                (4, "a"),
                (64, "b"),
                (math.inf, "a"),
            ],
        )


if __name__ == "__main__":
    run_tests()
