# Owner(s): ["module: inductor"]
"""A failure anywhere is a failure everywhere: choices that cannot be built, raise,
kill their rank, read before waiting, write into their input or take too long on one
rank or on all; each is dropped on every rank alike, or stops every rank clearly.
"""

from __future__ import annotations

import time

import torch
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
    DEVICE_CASES,
    Rank,
    run_ranks,
    short,
)
from collective_scenarios import (
    COMPILE_MARGIN_S,
    patched_timeout,
    register_two_choices,
    TIMEOUT_S,
)

# A benchmark timeout that a wait on a group its peers never joined would show.
TIMING_GROUP_TIMEOUT_S = 20.0


# -- a choice that cannot be built on one rank -----------------------------------------------


def unbuildable_body(r: Rank) -> list:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        ops.all_reduce_then(
            "unbuildable", before=lambda x: ops.lowering_fails_on_rank(x, 1)
        ),
        ops.reduce_scatter_all_gather,
    )
    group = r.group.group_name
    with patched_timeout(30.0):
        return compile_and_check(
            lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
        )


# -- a choice that raises at run time on one rank -------------------------------------------


PLANTED_FAULTS = {"raises": ops.fail_on_rank, "dies": ops.exit_on_rank}


def planted_fault_body(r: Rank, fault: str) -> list:
    """A choice named ``fault`` that raises, or exits, on rank 1 before its all-reduce."""
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        ops.all_reduce_then(fault, before=lambda x: PLANTED_FAULTS[fault](x, 1)),
    )
    group = r.group.group_name
    with patched_timeout():
        return compile_and_check(
            lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
        )


# -- a rank killed mid-session ------------------------------------------------------------------------


def dies_while_building_body(r: Rank, dying: int) -> dict:
    # Group rank ``dying`` dies while building its choices, once its peer waits for it.
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        ops.all_reduce_then(
            "dies_when_built", before=lambda x: ops.dies_when_lowered_on_rank(x, dying)
        ),
    )
    try:
        with patched_timeout():
            compile_and_check(
                lambda x: ops.all_reduce(x, r.group.group_name),
                torch.randn(8, 8, device=r.device),
            )
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "failed_at": time.time()}
    return {"error": None}


# -- a choice that reads a collective's output before waiting: Inductor waits there ----------------


def reads_before_wait_body(r: Rank) -> list:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"), ops.reads_before_wait
    )
    return compile_and_check(
        lambda x: ops.all_reduce(x, r.group.group_name),
        torch.randn(64, 64, device=r.device),
    )


def writes_input_body(r: Rank) -> list:
    ops.register_all_reduce(ops.writes_into_input, ops.all_reduce_then("slow"))
    x = torch.randn(8, 8, device=r.device)
    before = x.clone()
    records = compile_and_check(lambda t: ops.all_reduce(t, r.group.group_name), x)
    check.assertTrue(torch.equal(x, before), msg="the user's tensor changed")
    return records


# -- every call bounded ------------------------------------------------------------------------------


def slow_everywhere_body(r: Rank) -> list:
    # Each call of "stuck" takes 6 s on every rank; the budget is 2 s per choice.
    ops.register_all_reduce(
        ops.all_reduce_then("stuck", "6000"), ops.all_reduce_then("one_all_reduce")
    )
    with patched_timeout(2.0):
        return compile_and_check(
            lambda x: ops.all_reduce(x, r.group.group_name),
            torch.randn(8, 8, device=r.device),
        )


def slow_on_one_rank_body(r: Rank) -> dict:
    # "stuck" takes 8 s on rank 1 only: rank 0 gives up waiting for it in the next barrier.
    ops.register_all_reduce(
        ops.all_reduce_then("stuck", "0,8000"), ops.all_reduce_then("one_all_reduce")
    )
    begin = time.monotonic()
    try:
        with patched_timeout(2.0):
            compile_and_check(
                lambda x: ops.all_reduce(x, r.group.group_name),
                torch.randn(8, 8, device=r.device),
            )
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - begin}
    return {"error": None, "s": time.monotonic() - begin}


def stuck_then_eager_body(r: Rank, stuck_ms: str = "0,8000") -> dict:
    """A choice stuck past the timeout (``stuck_ms`` by rank: on rank 1) stops tuning
    on every rank; Dynamo falls back to eager (suppress_errors), whose all-reduce runs
    on the user's group: the benchmark timed on a group of its own, so that group is
    left working."""
    ops.register_all_reduce(
        ops.all_reduce_then("stuck", stuck_ms), ops.all_reduce_then("one_all_reduce")
    )
    x = torch.full((8, 8), float(r.rank + 1), device=r.device)
    with (
        patched_timeout(2.0),
        torch._dynamo.config.patch(suppress_errors=True),
    ):
        out = torch.compile(lambda t: ops.all_reduce(t, r.group.group_name))(x)
    after = torch.full((2,), float(r.rank + 1), device=r.device)
    torch.distributed.all_reduce(after, group=r.group)
    return {"out": out.cpu().tolist(), "after": after.cpu().tolist()}


# -- the benchmark's own group, where its ranks' views of it differ ------------------------


def one_sided_discard_body(r: Rank) -> dict:
    """Rank 0 alone forgets its timing group between two sites' benchmarks, as a
    benchmark that failed there alone does: the group makes a new one together."""
    from torch._inductor.runtime import collective_timing_group

    register_two_choices()
    group = r.group.group_name
    begin = time.monotonic()
    with patched_timeout(TIMING_GROUP_TIMEOUT_S):
        records = compile_and_check(
            lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
        )
        if r.rank == 0:
            collective_timing_group.discard(r.group, TIMING_GROUP_TIMEOUT_S)
        records += compile_and_check(
            lambda x: ops.all_reduce(x, group) * 2, torch.randn(16, 8, device=r.device)
        )
    return {"records": records, "s": time.monotonic() - begin}


def planted_connect_body(r: Rank, fault: str, timeout_s: float) -> dict:
    """Rank 1's first connect of a timing group meets ``fault``: "refused", its half
    fails after its peer's connected (a connection closed under load); "slow", it
    starts past the timeout's silence while its peer gives up on that group. The
    group makes the next one together and the benchmark goes on; the user's group
    still all-reduces. Starts without a held timing group (under torchrun an earlier
    test's may be held) and says whether the fault ran."""
    from unittest import mock

    from torch._inductor.runtime import collective_timing_group

    collective_timing_group.discard(r.group, timeout_s)
    made = collective_timing_group._made
    planted: list[int] = []

    def once(group, timeout, generation):
        first = r.rank == 1 and not planted
        planted.append(generation)
        if first and fault == "slow":
            time.sleep(timeout_s + 5.0)
        timing = made(group, timeout, generation)
        if first and fault == "refused":
            raise RuntimeError("Connection closed by peer (planted)")
        return timing

    register_two_choices()
    group = r.group.group_name
    begin = time.monotonic()
    with (
        mock.patch.object(collective_timing_group, "_made", once),
        patched_timeout(timeout_s),
    ):
        records = compile_and_check(
            lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
        )
    after = torch.ones(2, device=r.device)
    torch.distributed.all_reduce(after, group=r.group)
    return {
        "records": records,
        "s": time.monotonic() - begin,
        "after": after.cpu().tolist(),
        "planted": bool(planted) and r.rank == 1,
    }


class TestFailingChoices(CollectiveTestCase):
    @parametrize("device", DEVICE_CASES)
    def test_choice_that_cannot_be_built_on_one_rank_is_dropped_everywhere(
        self, device
    ):
        (a,), (b,) = assert_all_ok(run_ranks(2, unbuildable_body, device=device))
        self.assertEqual(a, b)
        self.assertEqual(a.decision, "benchmark")
        self.assertIn("dropped unbuildable (group rank 1: does not build", a.reason)
        self.assertIn("planted lowering failure on rank 1", a.reason)
        self.assertEqual(
            {short(t.name) for t in a.timings} - {"default"},
            {
                "one_all_reduce",
                "reduce_scatter_all_gather",
            },
        )

    @parametrize("device", DEVICE_CASES)
    def test_choice_raising_at_run_time_on_one_rank_stops_every_rank_clearly(
        self, device
    ):
        results = run_ranks(
            2, planted_fault_body, "raises", device=device, breaks_the_group=True
        )
        for result in results:
            self.assertIsNotNone(
                result.error, msg=f"rank {result.rank} went on: {result.value}"
            )
            self.assertIn("CollectiveAutotuneError", result.error)
            self.assertIn("raises", result.error, msg=result.error)  # the choice
            # The failing rank's report.
            self.assertIn("planted failure on rank 1", result.error, msg=result.error)
            self.assertLess(result.wall_s, 2 * TIMEOUT_S + COMPILE_MARGIN_S)

    @parametrize("device", DEVICE_CASES)
    def test_rank_killed_mid_session(self, device):
        survivor, dead = run_ranks(
            2, planted_fault_body, "dies", device=device, breaks_the_group=True
        )
        self.assertIsNone(dead.wall_s)  # it never reported
        self.assertIsNotNone(survivor.error)
        self.assertIn("CollectiveAutotuneError", survivor.error)
        # The choice it was running.
        self.assertIn("dies", survivor.error, msg=survivor.error)
        self.assertLess(survivor.wall_s, 2 * TIMEOUT_S + COMPILE_MARGIN_S)

    def test_a_rank_killed_while_its_peers_wait_for_it_fails_them_within_the_timeout(
        self,
    ):
        death = self.tmp_path / "died_at"
        survivor, dead = run_ranks(
            2,
            dies_while_building_body,
            1,
            env={"CAT_TEST_DEATH_FILE": str(death)},
            breaks_the_group=True,
        )
        self.assertIsNone(dead.wall_s)  # it never reported
        self.assertTrue(survivor.ok, msg=survivor)
        self.assertIsNotNone(survivor.value["error"], msg=survivor)
        error = survivor.value["error"]
        # Nothing stored: the ranks build the site's choices before its one vote, which waits.
        self.assertIn("CollectiveAutotuneError: site/", error, msg=error)
        self.assertIn(": group ranks [1] did not report", error, msg=error)
        self.assertIn("group rank 1 was last heard", error, msg=error)
        self.assertIn("compiling the choices of site/", error, msg=error)
        from torch.distributed._store_session import look_interval

        # Within the timeout and one look interval of silence (the docs' fault table;
        # bounded here at five times that).
        self.assertLess(
            survivor.value["failed_at"] - float(death.read_text()),
            5 * (TIMEOUT_S + look_interval(TIMEOUT_S)),
        )

    def test_a_choice_reading_a_collective_before_waiting_is_waited_for_and_timed_on_every_rank(
        self,
    ):
        (a,), (b,) = assert_all_ok(
            run_ranks(2, reads_before_wait_body)
        )  # compiled == eager
        self.assertEqual(a, b)  # the same decision, and the same words, on every rank
        self.assertEqual(a.decision, "benchmark", msg=str(a))
        self.assertEqual(
            {short(t.name): t.status for t in a.timings}["reads_before_wait"],
            "ok",
            msg=str(a),
        )

    @single_process
    def test_a_screen_rejection_names_each_rank_and_its_error(self):
        from torch._inductor.runtime.collective_benchmarking import _rejection

        wrong = "rejected: output differs from the reference (max abs error 7.95)"
        # A rank that accepted the choice has no report ("").
        self.assertEqual(
            _rejection([wrong, ""]),
            f"rejected by group ranks [0] (group rank 0: {wrong}), accepted by group ranks [1]: a "
            "result that differs between ranks suggests it reads data before a collective completed",
        )
        self.assertEqual(
            _rejection([wrong, wrong]),
            f"rejected by every rank: group rank 0: {wrong}; group rank 1: {wrong}",
        )

    def test_a_choice_that_writes_into_its_input_is_dropped(self):
        (a,), (b,) = assert_all_ok(run_ranks(2, writes_input_body))
        self.assertEqual(a, b)
        self.assertNotEqual(a.winner, "writes_into_input")
        # Found in its traced graph, on every rank alike: never timed, never inlined.
        self.assertIn(
            "dropped writes_into_input (group ranks [0, 1]: writes into input 0 (aten::copy_), which the op "
            "does not declare it mutates)",
            a.reason,
            msg=a.reason,
        )
        self.assertNotIn("writes_into_input", {t.name for t in a.timings})

    @single_process
    def test_the_screen_rejects_a_call_that_wrote_into_an_input(self):
        from torch._inductor.runtime.collective_benchmarking import (
            _verdict,
            ScreenInputs,
            Verdict,
        )

        x = torch.ones(4)
        inputs = ScreenInputs([x])
        x.add_(1)  # what a call did to its input
        self.assertEqual(
            _verdict(x, x, inputs.written()),
            (float(Verdict.WROTE_INPUT), 0.0),
            atol=0,
            rtol=0,
        )
        inputs.reset()
        self.assertIsNone(inputs.written())
        self.assertTrue(torch.equal(x, torch.ones(4)))
        declared = ScreenInputs([x], mutable=[0])  # the op says it writes into input 0
        x.add_(1)
        self.assertIsNone(declared.written())

    def test_a_choice_slow_on_every_rank_is_dropped_after_one_call(self):
        results = run_ranks(2, slow_everywhere_body)
        (a,), (b,) = assert_all_ok(results)
        self.assertEqual(a, b)
        self.assertNotEqual(a.winner, "stuck")
        status = {t.name: t.reason for t in a.timings}
        self.assertTrue(
            status["stuck"].startswith("over budget: its first call took 6"), msg=status
        )
        self.assertIn("collective_benchmark_timeout=2 s", status["stuck"])
        # One call of it, not one per sample.
        self.assertLess(max(r.wall_s for r in results), 6.0 + COMPILE_MARGIN_S)

    def test_after_a_choice_stuck_on_one_rank_the_users_group_still_works(self):
        total = float(sum(range(1, 3)))
        for result in assert_all_ok(run_ranks(2, stuck_then_eager_body)):
            self.assertEqual(result["out"], [[total] * 8] * 8)
            self.assertEqual(result["after"], [total] * 2)

    def test_a_choice_stuck_on_one_rank_stops_every_rank_clearly(self):
        fast, stuck = assert_all_ok(
            run_ranks(2, slow_on_one_rank_body, breaks_the_group=True)
        )
        for result in (fast, stuck):
            self.assertIsNotNone(result["error"], msg=result)
            self.assertIn("CollectiveAutotuneError", result["error"], msg=result)
        # The stuck rank learns it when its call returns, at once.
        self.assertIn(
            "stopped on every rank of the group", stuck["error"], msg=stuck["error"]
        )
        self.assertLess(stuck["s"], 8.0 + COMPILE_MARGIN_S)

    def test_a_timing_group_forgotten_on_one_rank_is_made_anew_by_all(self):
        for result in assert_all_ok(run_ranks(2, one_sided_discard_body)):
            self.assertEqual(
                [rec.decision for rec in result["records"]], ["benchmark"] * 2
            )
            # Agreed in the Store: nobody waited out a timeout on the other's group.
            self.assertLess(result["s"], TIMING_GROUP_TIMEOUT_S + COMPILE_MARGIN_S)

    @parametrize("fault", ["refused", "slow"])
    def test_a_timing_group_one_rank_could_not_join_is_made_again(self, fault: str):
        # Short: "slow" waits out several of gloo's connect timeouts.
        timeout = 8.0
        results = assert_all_ok(run_ranks(2, planted_connect_body, fault, timeout))
        self.assertTrue(results[1]["planted"], msg="the planted fault never ran")
        for result in results:
            (record,) = result["records"]
            self.assertEqual(record.decision, "benchmark", msg=record)
            # The fault, the failed connect it left the peer, one more: bounded.
            self.assertLess(result["s"], 6 * timeout + COMPILE_MARGIN_S)
            self.assertEqual(result["after"], [2.0, 2.0])


instantiate_parametrized_tests(TestFailingChoices)


if __name__ == "__main__":
    run_tests()
