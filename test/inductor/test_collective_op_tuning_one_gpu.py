# Owner(s): ["module: inductor"]
"""The GPU paths on one GPU, where machines of several GPUs are not at hand.

A NCCL group of one rank still runs everything but the waiting: its sessions, the
screen, graph-mode timing in CUDA graphs, the ladder of a dynamic op and its size
dispatch inside CUDA graphs, kept decisions and their screen. Choices whose cost grows
with size (GPU sleeps) make the winner change with size, so that the dispatch runs.
Every case skips without CUDA; under torchrun with more than one rank they skip too.
"""

from __future__ import annotations

import json
import unittest

import torch
from torch._dynamo.utils import counters
from torch.testing._internal.common_utils import run_tests

import collective_ops as ops
from collective_harness import (
    CollectiveTestCase,
    assert_all_ok,
    compile_and_check,
    Rank,
    REAL,
    run_ranks,
)
from collective_scenarios import decision_files, NO_GRAPH_CACHES
from test_collective_op_tuning import check_agreement, one_op_body
from test_collective_op_tuning_conformance import check_in_place_choice_wins
from test_collective_op_tuning_failing_choices import (
    stuck_then_eager_body,
    writes_input_body,
)
from test_collective_op_tuning_persistence import ZEROES_COSTS, zeroes_body
from test_collective_op_tuning_graphs import (
    cells_of,
    DESIGNED_CELLS,
    DESIGNED_WINNERS,
    forward_and_backward_body,
    LADDER_SIZES,
    mixed_winner_layers,
    probes_of,
)


def graph_mode_sizes_body(r: Rank, range_graphs: bool) -> dict:
    """Six layers compiled once with CUDA graphs and a dynamic token dimension, whose
    all-reduce's winner changes with size (an inlined one, an opaque op, the op's own):
    one graph per size range, or one graph dispatching by size inside."""
    from torch._inductor.kernel.collective.api import collective_autotune_records

    model, _ = mixed_winner_layers(r, 6)

    start = len(collective_autotune_records())
    skips = counters["inductor"]["cudagraph_skips"]
    dispatches = counters["inductor"]["collective_autotune_size_dispatches"]
    uncompiled = counters["inductor"]["collective_autotune_uncompiled_choices"]
    compiled = torch.compile(
        model, mode="reduce-overhead", dynamic=True, fullgraph=True
    )
    ran, graphs = {}, []
    with torch._inductor.config.patch(
        collective_autotune_dynamic_max=256,
        collective_autotune_range_graphs=range_graphs,
    ):
        for n in (8, 2, 30, 100, 2, 30):
            x = torch.randn(n, 4, device=r.device)
            ops.ran.clear()
            out = compiled(x).clone()
            torch.cuda.synchronize()
            ran.setdefault(n, sorted({t for t in ops.ran if t != "default"}))
            graphs.append(counters["stats"]["unique_graphs"])
            torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    return {
        "ran": ran,
        "graphs": graphs,
        "records": collective_autotune_records()[start:],
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips,
        "dispatching_sites": counters["inductor"]["collective_autotune_size_dispatches"]
        - dispatches,
        "uncompiled_choices": counters["inductor"][
            "collective_autotune_uncompiled_choices"
        ]
        - uncompiled,
    }


def check_each_size_ran_its_winner(test: CollectiveTestCase, result: dict) -> None:
    test.assertEqual(result["cudagraph_skips"], 0)
    # The opaque op is timed uncompiled (as it runs in the model: called) and still
    # wins its ranges.
    test.assertGreater(result["uncompiled_choices"], 0)
    records = result["records"]
    test.assertEqual({r.mode for r in records}, {"graph"})
    # The probes' winners and the cells between the crossovers, from the records' data
    # (never from a range's generated name), as DesignedCosts gives them.
    ladder = {m.size: m.winner for m in probes_of(records)}
    test.assertEqual([ladder[n] for n in LADDER_SIZES], DESIGNED_WINNERS)
    test.assertEqual(cells_of(records), DESIGNED_CELLS)
    # Under CUDA graphs only the first call of a size records (and marks): each size's
    # winner ran there, 100 rows the opaque op (below the crossover at 120).
    test.assertEqual(result["ran"][2], ["per_row_cost"])
    test.assertEqual(result["ran"][100], ["opaque"])


def graph_mode_one_op_body(r: Rank) -> list:
    ops.register_standard_ops()
    with torch._inductor.config.patch({"triton.cudagraphs": True}):
        return compile_and_check(
            lambda x: ops.all_reduce(x, r.group.group_name) * 2,
            torch.randn(256, 64, device=r.device),
        )


def default_mode_as_traced_body(r: Rank, with_pointwise_choice: bool) -> dict:
    """A produced all-reduce in the default mode, its choices an inlined functional
    all-reduce and an opaque op, and with ``with_pointwise_choice`` one that
    Inductor's compile fuses (a cat of chunks)."""
    choices = [ops.all_reduce_then("one_all_reduce"), ops.opaque]
    if with_pointwise_choice:
        choices.append(ops.chunked_all_reduce)
    ops.register_all_reduce(*choices)
    group = r.group.group_name
    uncompiled = counters["inductor"]["collective_autotune_uncompiled_choices"]
    records = compile_and_check(
        lambda x: ops.all_reduce(torch.relu(x), group) * 2,
        torch.randn(64, 32, device=r.device),
    )
    return {
        "records": records,
        "uncompiled_choices": counters["inductor"][
            "collective_autotune_uncompiled_choices"
        ]
        - uncompiled,
    }


@unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")
class TestOneGpu(CollectiveTestCase):
    def test_one_op_is_screened_and_timed_on_one_gpu(self):
        # Timed for real, on the GPU.
        (record,) = check_agreement(
            run_ranks(1, one_op_body, device="cuda", timing=REAL), 1, 1
        )
        self.assertEqual(record.mode, "eager")
        self.assertEqual(record.group_ranks, (0,))

    def test_the_default_mode_times_choices_as_traced_all_or_none_on_one_gpu(self):
        (alike,) = assert_all_ok(
            run_ranks(
                1,
                default_mode_as_traced_body,
                False,
                device="cuda",
                timing=ops.DesignedCosts(own_ms=2.0),
            )
        )
        (record,) = alike["records"]
        # Both choices run as traced (the functional all-reduce in place on the
        # producer's stand-in), and the fastest wins: the opaque op costs 6 ms.
        self.assertEqual(record.mode, "eager")
        self.assertEqual(alike["uncompiled_choices"], 2)
        self.assertTrue(record.winner.endswith("one_all_reduce"), msg=record.winner)
        (mixed,) = assert_all_ok(
            run_ranks(1, default_mode_as_traced_body, True, device="cuda")
        )
        # A choice the compile fuses: every choice is compiled, to launch alike.
        self.assertEqual(mixed["uncompiled_choices"], 0)
        self.assertFalse(mixed["records"][0].winner.endswith("opaque"))

    def test_a_size_dispatch_runs_inside_cuda_graphs_on_one_gpu(self):
        (result,) = assert_all_ok(
            run_ranks(
                1,
                graph_mode_sizes_body,
                False,
                device="cuda",
                timeout_s=300,
                timing=ops.DesignedCosts(),
            )
        )
        check_each_size_ran_its_winner(self, result)
        self.assertGreater(result["dispatching_sites"], 0)
        self.assertEqual(len(set(result["graphs"])), 1)

    def test_each_size_range_is_a_cuda_graph_tree_of_its_own_on_one_gpu(self):
        (result,) = assert_all_ok(
            run_ranks(
                1,
                graph_mode_sizes_body,
                True,
                device="cuda",
                timeout_s=300,
                timing=ops.DesignedCosts(),
            )
        )
        check_each_size_ran_its_winner(self, result)
        # One graph per range visited (2, 8 and 30, 100 lie in different cells), none inside
        # dispatching, and sizes seen before compile nothing more.
        self.assertEqual(result["dispatching_sites"], 0)
        self.assertEqual(result["graphs"][-2:], result["graphs"][3:4] * 2)
        self.assertGreater(len(set(result["graphs"])), 1)

    def test_forward_and_backward_dispatch_on_one_gpu(self):
        (result,) = assert_all_ok(
            run_ranks(
                1,
                forward_and_backward_body,
                False,
                device="cuda",
                timeout_s=300,
                timing=ops.DesignedCosts(),
            )
        )
        self.assertEqual(result["frames"], 1)
        # Three sites in the forward graph and three in the backward, each of the probes.
        probes = len({r.size for r in result["records"]})
        self.assertEqual(len(result["records"]), 6 * probes)

    def test_a_kept_decision_is_screened_again_on_one_gpu(self):
        env = {
            "TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}"),
            **NO_GRAPH_CACHES,
        }

        def restart():
            ((record,),) = assert_all_ok(
                run_ranks(
                    1,
                    zeroes_body,
                    device="cuda",
                    env=env,
                    restarts=True,
                    timing=ZEROES_COSTS,
                )
            )
            return record

        first = restart()
        self.assertEqual(first.source, "benchmark")
        (entry,) = decision_files(self.tmp_path, 0)
        data = json.loads(entry.read_text())
        data["winner"] = "zeroes"
        entry.write_text(json.dumps(data))
        again = restart()
        self.assertEqual(again.source, "benchmark")
        self.assertNotEqual(again.winner, "zeroes")
        self.assertIn("the stored winner failed its screen", again.reason)

    def test_a_choice_writing_into_its_input_is_dropped_on_one_gpu(self):
        ((record,),) = assert_all_ok(run_ranks(1, writes_input_body, device="cuda"))
        self.assertNotEqual(record.winner, "writes_into_input", msg=str(record))
        self.assertIn("writes into input 0", record.reason, msg=record)

    def test_graph_mode_timing_on_one_gpu(self):
        ((record,),) = assert_all_ok(
            run_ranks(1, graph_mode_one_op_body, device="cuda")
        )
        self.assertEqual(record.mode, "graph")
        self.assertEqual(record.source, "benchmark")
        # Samples are CUDA-graph batches: several calls each, and at least two for a
        # choice whose one call lasts a sample.
        ok = [t for t in record.timings if t.status == "ok"]
        self.assertTrue(ok, msg=record)
        for t in ok:
            self.assertGreaterEqual(t.calls_per_sample, 2, msg=t)
            if t.max_us < 100.0:
                self.assertGreaterEqual(t.calls_per_sample, 8, msg=t)

    def test_an_in_place_dist_all_reduce_is_timed_and_wins_on_one_gpu(self):
        # NCCL: dist.all_reduce on the choice's own tensor, traced as a functional one.
        check_in_place_choice_wins(self, 1, "cuda")

    def test_after_a_choice_stuck_on_the_gpu_the_users_group_still_works(self):
        # Stuck on the device past the timeout: the timing group's communicator is
        # aborted, never the user's, whose all-reduce runs after the fallback.
        (result,) = assert_all_ok(
            run_ranks(1, stuck_then_eager_body, "8000", device="cuda")
        )
        self.assertEqual(result["out"], [[1.0] * 8] * 8)
        self.assertEqual(result["after"], [1.0] * 2)


if __name__ == "__main__":
    run_tests()
