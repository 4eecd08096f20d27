# Owner(s): ["module: inductor"]
"""Never hang, never disagree, whenever ranks arrive: late and absent ranks, ranks
that compile different ops or have different histories, concurrent groups, a stress of
sessions with mixed arrivals, and waits that last while a peer works and end when it is
silent.

Each scenario asserts the same decision on every rank of a group (read from the
decision records), correct outputs, and waits bounded by the timeout knob.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import time

import torch
import torch.distributed as dist
from torch._inductor.kernel.collective.api import collective_autotune_records
from torch._inductor.runtime import collective_protocol
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import collective_ops as ops
from collective_harness import (
    CollectiveTestCase,
    assert_all_ok,
    compile_and_check,
    Costs,
    DEVICE_CASES,
    Rank,
    run_ranks,
    short,
)
from collective_scenarios import (
    arriving_after,
    arriving_after_the_decision,
    COMPILE_MARGIN_S,
    DECIDED,
    JOINED,
    patched_timeout,
    register_two_choices,
    TIMEOUT_S,
)


def late_rank_body(r: Rank, late_rank: int) -> list:
    register_two_choices()
    group = r.group.group_name
    with arriving_after_the_decision(r, late_rank, "late_rank"), patched_timeout():
        return compile_and_check(
            lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
        )


# -- a rank that never tunes this op -----------------------------------------------------


def never_tunes_body(r: Rank) -> list:
    register_two_choices()
    group = r.group.group_name
    x = torch.randn(8, 8, device=r.device)
    start = len(collective_autotune_records())
    with patched_timeout():
        if r.rank == 0:
            return compile_and_check(lambda t: ops.all_reduce(t, group), x)
        # Rank 1 runs the op eagerly, i.e. its default implementation, twice as
        # compile_and_check does (the compiled call and the eager reference).
        ops.all_reduce(x, group)
        ops.all_reduce(x, group)
        return collective_autotune_records()[start:]


# -- ranks that compile different ops at the same point (non-SPMD) ------------------------------------


def non_spmd_body(r: Rank) -> dict:
    register_two_choices()
    group = r.group.group_name

    def fn(x):
        return ops.all_reduce(x, group) * 2

    # Rank 0 compiles the op for an 8x8 input while rank 1 compiles it for 16x4, then
    # each compiles the other: different sessions meet at the same point. The inputs
    # have the same number of elements, so the collectives the ranks run meanwhile
    # (each its own decision, the eager references) still pair up at run time.
    shapes = [(8, 8), (16, 4)] if r.rank == 0 else [(16, 4), (8, 8)]
    records = []
    with patched_timeout():
        for shape in shapes:
            records += compile_and_check(fn, torch.randn(*shape, device=r.device))
    return {rec.key: rec for rec in records}


# -- two groups tuning concurrently, one starting late ----------------------------------------------


def two_groups_one_late_body(r: Rank) -> list:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[r.rank // 2]
    register_two_choices()
    # The second group starts once the first is in its session: both tune at once.
    with arriving_after(r, (2, 3), "two_groups", JOINED), patched_timeout():
        return compile_and_check(
            lambda x: ops.all_reduce(x, mine.group_name),
            torch.randn(8, 8, device=r.device),
        )


# -- stress: 20 sessions, mixed arrivals ------------------------------------------------------------------


STRESS_SESSIONS = 20
STRESS_TIMEOUT_S = 2.0
# How a session's ranks arrive: together, one once its peer joined (waited for within
# the timeout), or one once its peer decided without it (after the timeout).
ARRIVALS = (None, JOINED, DECIDED)


def stress_arrivals(seed: int) -> list[tuple[int, str | None]]:
    """Each session's late rank and when it arrives; the same on every rank."""
    rng = random.Random(seed)
    return [(rng.randrange(2), rng.choice(ARRIVALS)) for _ in range(STRESS_SESSIONS)]


def stress_body(r: Rank, seed: int) -> list:
    register_two_choices()
    group = r.group.group_name

    def fn(x):
        return ops.all_reduce(x, group) + 1

    with (
        patched_timeout(STRESS_TIMEOUT_S),
        torch._dynamo.config.patch(recompile_limit=64),
    ):
        for i, (late, moment) in enumerate(stress_arrivals(seed)):
            with arriving_after(r, (late,), f"stress/{i}", moment):
                compile_and_check(fn, torch.randn(8 * (i + 1), 8, device=r.device))
    return collective_autotune_records()[-STRESS_SESSIONS:]


# -- ranks with different compile histories -------------------------------------------------------


def different_histories_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name
    if r.rank == 0:
        # Inductor numbers subgraph choices with a process-wide counter: this
        # compile, on rank 0 alone, shifts rank 0's numbers.
        compile_and_check(
            lambda x: ops.scale(x) + 1, torch.randn(8, 8, device=r.device)
        )
    return compile_and_check(
        lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device)
    )


# -- a rank that tuned an op alone does not stall or shift later sessions ---------------------------


def tuned_alone_body(r: Rank) -> dict:
    register_two_choices()
    group = r.group.group_name
    x = torch.randn(8, 8, device=r.device)
    y = torch.randn(16, 8, device=r.device)
    start = len(collective_autotune_records())
    phases = {}
    with patched_timeout(2 * TIMEOUT_S):
        if r.rank == 0:
            compile_and_check(
                lambda t: ops.all_reduce(t, group), x
            )  # alone: falls back
        else:
            ops.all_reduce(x, group)  # the eager calls that pair with rank 0's
            ops.all_reduce(x, group)
        phases["alone"] = collective_autotune_records()[start:]
        # Both compile that op: the group decided it (rank 0's fallback), so neither
        # waits (rank 0 may even load the graph from its cache).
        torch._dynamo.reset()
        member = (
            collective_protocol._participant
        )  # rank 1 has none yet: it only ran eager
        waited_before = member.waited_s if member is not None else 0.0
        phases["same"] = compile_and_check(lambda t: ops.all_reduce(t, group), x)
        # Every wait of the protocol in that compile, the sessions' and any other.
        phases["same_waited_s"] = (
            collective_protocol._participant.waited_s - waited_before
        )
        # A new shape: the group meets in one session and tunes it together.
        torch._dynamo.reset()
        phases["new"] = compile_and_check(lambda t: ops.all_reduce(t, group) + 1, y)
    return phases


# -- waits bound silence, not work ----------------------------------------------------------------


LIVENESS_TIMEOUT_S = 5.0
# Longer than three timeouts: no wait may end while the cold rank works.
SLOW_TRACE_S = 16.0


def vote_after_body(r: Rank, works: bool) -> dict:
    """Rank 1 votes 3 s late, working (beating) meanwhile or silent; the timeout is 1 s."""
    from torch._inductor.runtime.collective_protocol import (
        CollectiveAutotuneError,
        CollectiveSession,
        participant,
    )

    member = participant(1.0)
    session = CollectiveSession(
        member,
        r.group.group_name,
        f"vote_after/{works}",
        r.rank,
        dist.get_process_group_ranks(r.group),
        timeout=1.0,
    )
    # Both ranks start the clock together: a rank that reached this test later (a
    # busy host, a slow previous test) would otherwise see a shorter wait.
    dist.barrier(group=r.group)
    begin = time.monotonic()
    if r.rank == 1:
        # The fault under test: rank 1 stalls three timeouts before it votes (working
        # or silent meanwhile). Its length is the point; nothing to wait for instead.
        with (
            member.liveness.working("working on purpose")
            if works
            else contextlib.nullcontext()
        ):
            time.sleep(3.0)
    try:
        session.vote("late", "ok")
        return {"error": None, "s": time.monotonic() - begin}
    except CollectiveAutotuneError as e:
        return {"error": str(e), "s": time.monotonic() - begin}


# Three choices that all lose to the op's own implementation, 20x slower.
OWN_WINS = Costs(own_us=1e3, other_us=20e3)


def warm_cold_body(r: Rank) -> list:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        ops.slow_to_trace("slow_to_trace"),
        ops.all_reduce_then("another_all_reduce"),
    )
    with patched_timeout(LIVENESS_TIMEOUT_S):
        return compile_and_check(
            lambda x: ops.all_reduce(x, r.group.group_name) + 1,
            torch.randn(8, 8, device=r.device),
        )


class TestArrivals(CollectiveTestCase):
    @parametrize("device", DEVICE_CASES)
    def test_rank_arriving_after_the_timeout_follows_the_decision_at_once(self, device):
        results = run_ranks(2, late_rank_body, 1, device=device)
        (early,), (late,) = assert_all_ok(results)
        self.assertEqual(early, late)
        self.assertEqual(early.decision, "use")
        self.assertEqual(short(early.winner), "default")
        self.assertIn("did not arrive", early.reason)
        self.assertGreaterEqual(early.waited_s, TIMEOUT_S * 0.9)
        # It read the decision instead of starting a wait (one would last TIMEOUT_S).
        self.assertLess(late.waited_s, TIMEOUT_S / 2)
        self.assertLess(
            max(r.wall_s for r in results), TIMEOUT_S + 2 * COMPILE_MARGIN_S
        )

    @parametrize("device", DEVICE_CASES)
    def test_rank_that_never_tunes_the_op(self, device):
        results = run_ranks(2, never_tunes_body, device=device)
        (tuned,), untouched = assert_all_ok(results)
        self.assertEqual(untouched, [])
        self.assertEqual(tuned.decision, "use")
        self.assertEqual(short(tuned.winner), "default")
        self.assertLess(max(r.wall_s for r in results), TIMEOUT_S + COMPILE_MARGIN_S)

    @parametrize("device", DEVICE_CASES)
    def test_ranks_compiling_different_ops_at_the_same_point(self, device):
        results = run_ranks(2, non_spmd_body, device=device)
        first, second = assert_all_ok(results)
        # Each rank waited once, alone, and fell back; the other rank's later compile of
        # that shape followed that decision of the group, without waiting.
        self.assertEqual(first.keys(), second.keys())
        self.assertEqual(len(first), 2)
        for key in first:
            self.assertEqual(first[key], second[key])
            self.assertEqual(first[key].winner, "default")
        self.assertEqual(
            sorted(
                rec.waited_s > TIMEOUT_S * 0.9
                for rec in [*first.values(), *second.values()]
            ),
            [False, False, True, True],
        )
        self.assertLess(
            max(r.wall_s for r in results), 2 * TIMEOUT_S + COMPILE_MARGIN_S
        )

    @parametrize("device", DEVICE_CASES)
    def test_two_groups_tuning_concurrently_one_starting_late(self, device):
        per_rank = assert_all_ok(run_ranks(4, two_groups_one_late_body, device=device))
        (a0,), (a1,), (b0,), (b1,) = per_rank
        self.assertEqual(a0, a1)
        self.assertEqual(b0, b1)
        self.assertEqual(a0.decision, b0.decision)
        self.assertEqual(b0.decision, "benchmark")
        # The punctual group never waited on the late one.
        self.assertLess(a0.waited_s, TIMEOUT_S)
        self.assertLess(a1.waited_s, TIMEOUT_S)

    def test_stress_twenty_sessions_with_mixed_arrivals(self):
        # Every kind.
        self.assertEqual({moment for _, moment in stress_arrivals(7)}, set(ARRIVALS))
        results = run_ranks(2, stress_body, 7, timeout_s=600)
        a, b = assert_all_ok(results)  # zero hangs
        self.assertEqual(len(a), len(b))
        self.assertEqual(len(b), STRESS_SESSIONS)
        self.assertEqual(a, b)  # zero disagreements
        # Each session either timed its key with the whole group or fell back, for this job only.
        self.assertTrue(
            all(
                rec.decision == "benchmark"
                or (rec.winner == "default" and rec.provisional)
                for rec in a
            ),
            msg=a,
        )
        # A rank arriving after its peer decided finds a fallback.
        for rec, (_, moment) in zip(a, stress_arrivals(7)):
            if moment == DECIDED:
                self.assertEqual(rec.winner, "default", msg=str(rec))
                self.assertTrue(rec.provisional, msg=rec)

    @parametrize("device", DEVICE_CASES)
    def test_ranks_with_different_compile_histories_still_tune_together(self, device):
        (a,), (b,) = assert_all_ok(
            run_ranks(2, different_histories_body, device=device)
        )
        self.assertEqual(a, b)
        self.assertEqual(a.decision, "benchmark")

    @parametrize("device", DEVICE_CASES)
    def test_rank_that_tuned_alone_does_not_stall_later_sessions(self, device):
        first, second = assert_all_ok(run_ranks(2, tuned_alone_body, device=device))
        (alone,) = first["alone"]
        self.assertEqual(alone.decision, "use")
        self.assertEqual(alone.winner, "default")
        self.assertEqual(second["alone"], [])
        # Rank 1 follows the group's decision without a wait of its own.
        (same,) = second["same"]
        self.assertEqual(same.winner, "default")
        # No wait: one would last the body's timeout, 2 * TIMEOUT_S.
        self.assertLess(same.waited_s, TIMEOUT_S)
        self.assertTrue(all(rec.winner == "default" for rec in first["same"]))
        self.assertLess(second["same_waited_s"], TIMEOUT_S)
        (new0,), (new1,) = first["new"], second["new"]
        self.assertEqual(new0, new1)
        self.assertEqual(new0.decision, "benchmark")

    @parametrize("works", [True, False])
    def test_a_vote_waits_for_a_working_peer_and_not_for_a_silent_one(self, works):
        early, late = assert_all_ok(run_ranks(2, vote_after_body, works))
        self.assertIsNone(late["error"])
        if works:
            self.assertIsNone(early["error"])
            self.assertGreater(early["s"], 2.5)
        else:
            self.assertIn(
                "late: group ranks [1] did not report and were silent for 1 s",
                early["error"],
            )
            # Under torchrun, rank 1 beat in earlier tests: then it says where, long ago.
            self.assertTrue(
                "group rank 1 never reported progress" in early["error"]
                or "group rank 1 was last heard" in early["error"]
            )
            from torch.distributed._store_session import look_interval

            # (Five times the timeout and a look interval: a bound, not a measurement.)
            self.assertLess(early["s"], 5 * (1.0 + look_interval(1.0)))

    def test_a_cold_rank_compiling_longer_than_the_timeout_is_waited_for(self):
        env = {"TORCHINDUCTOR_CACHE_DIR": str(self.tmp_path / "{rank}")}
        (first,), _ = assert_all_ok(
            run_ranks(2, warm_cold_body, env=env, restarts=True, timing=OWN_WINS)
        )
        shutil.rmtree(self.tmp_path / "1")  # rank 1 cold; rank 0 warm
        slow = {
            **env,
            "CAT_TEST_SLOW_TRACE_RANK": "1",
            "CAT_TEST_SLOW_TRACE_S": str(SLOW_TRACE_S),
        }
        results = run_ranks(2, warm_cold_body, env=slow, restarts=True, timing=OWN_WINS)
        (warm,), (cold,) = assert_all_ok(results)
        # The warm rank waited (its cache hit, then its votes) through the cold rank's
        # compile, over three timeouts long, and both tuned together.
        self.assertGreater(results[0].wall_s, SLOW_TRACE_S)
        self.assertEqual(warm, cold)
        self.assertEqual(warm.source, "benchmark")
        self.assertEqual(warm.winner, first.winner)
        self.assertEqual(first.winner, "default")


instantiate_parametrized_tests(TestArrivals)


if __name__ == "__main__":
    run_tests()
