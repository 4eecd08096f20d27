# Owner(s): ["module: inductor"]
"""Unit tests of what collective autotuning remembers: one state per graph, made at
first use and dropped with the graph; per function and per frame, as long as they live."""

from __future__ import annotations

import gc
import weakref

from torch._inductor.kernel.collective.graph_state import (
    frame_state,
    function_memo,
    graph_state,
    recorded_memo,
)
from torch.testing._internal.common_utils import run_tests, TestCase


class _Owner:
    """Stands for a GraphLowering or a ShapeEnv: any object with weak references."""


class TestCollectiveOpTuningUnitsState(TestCase):
    def test_a_graphs_state_is_made_once_and_dropped_with_the_graph(self):
        graph = _Owner()
        state = graph_state(graph)  # type: ignore[arg-type]
        state.partitions["s0"] = {64.0}
        self.assertIs(graph_state(graph), state)  # type: ignore[arg-type]
        self.assertEqual(graph_state(_Owner()).partitions, {})  # type: ignore[arg-type]
        dropped = weakref.ref(state)
        del graph, state
        gc.collect()
        self.assertIsNone(dropped())

    def test_a_functions_memo_lives_as_long_as_the_function(self):
        def implementation() -> None:
            pass

        self.assertIsNone(recorded_memo(implementation))
        memo = function_memo(implementation)
        memo.wrapped = (print, None)
        self.assertIs(recorded_memo(implementation), memo)
        dropped = weakref.ref(memo)
        del implementation, memo
        gc.collect()
        self.assertIsNone(dropped())

    def test_what_cannot_be_weakly_referenced_has_no_memo(self):
        self.assertIsNone(recorded_memo(None))
        self.assertIsNone(recorded_memo(object()))
        with self.assertRaises(TypeError):
            function_memo(object())  # type: ignore[arg-type]

    def test_a_frames_state_is_kept_by_its_shape_env_apart_from_memos(self):
        shape_env = _Owner()
        frame_state(shape_env).ladder_uppers["s0"] = 4096
        self.assertEqual(frame_state(shape_env).ladder_uppers, {"s0": 4096})
        self.assertIsNone(recorded_memo(shape_env))
        self.assertEqual(frame_state(_Owner()).ladder_uppers, {})


if __name__ == "__main__":
    run_tests()
