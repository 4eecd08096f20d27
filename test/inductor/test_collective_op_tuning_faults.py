"""Never hang, never disagree: the cross-rank protocol under late, absent, failing
and dying ranks, warm caches, non-SPMD compiles, concurrent groups and bad knobs.

Each scenario asserts bounded wall time, the same decision on every rank of a group
(read from the decision records), and correct outputs where the job can go on.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
import shutil
import subprocess
import sys
import time
import unittest.mock

import pytest
import torch
import torch.distributed as dist
from torch._inductor.kernel.collective.hooks import collective_autotune_records
from torch._inductor.runtime import collective_protocol

import collective_ops as ops
from collective_harness import assert_all_ok, compile_and_check, DEVICES, environment, Rank, run_ranks, short


TIMEOUT_S = 4.0
# Compiling the choices on a loaded 2-core machine, before and after a session.
COMPILE_MARGIN_S = 60.0


def patched_timeout(seconds: float = TIMEOUT_S):
    return torch._inductor.config.patch(collective_benchmark_timeout=seconds)


def register_two_choices() -> None:
    ops.register_all_reduce(ops.all_reduce_then("one_all_reduce"), ops.reduce_scatter_all_gather)


# -- a rank arriving after the timeout ---------------------------------------------------


@contextlib.contextmanager
def arriving_after_the_decision(r: Rank, late_rank: int, tag: str):
    """Rank ``late_rank`` enters the block once the other ranks' session has decided
    without it (they waited the timeout); the others enter at once.

    A fixed head start for the punctual ranks is not enough: how long their compile
    takes to reach the session varies (up to 6 s on a loaded 2-core machine), and a
    late rank whose compile began before they gave up would keep their wait alive."""
    store = dist.distributed_c10d._get_default_store()
    key = f"test/{r.group.group_name}/{tag}/decided"
    if r.rank == late_rank:
        store.wait([key], datetime.timedelta(seconds=COMPILE_MARGIN_S))
        yield
        return
    agree = collective_protocol.CollectiveSession.agree

    def agree_then_say_so(session, *args, **kwargs):
        decision = agree(session, *args, **kwargs)
        store.set(key, "1")
        return decision

    with unittest.mock.patch.object(collective_protocol.CollectiveSession, "agree", agree_then_say_so):
        yield


def late_rank_body(r: Rank, late_rank: int) -> list:
    register_two_choices()
    group = r.group.group_name
    with arriving_after_the_decision(r, late_rank, "late_rank"), patched_timeout():
        return compile_and_check(lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device))


@pytest.mark.parametrize("device", DEVICES)
def test_rank_arriving_after_the_timeout_follows_the_decision_at_once(device):
    results = run_ranks(2, late_rank_body, 1, device=device)
    (early,), (late,) = assert_all_ok(results)
    assert early == late and early.decision == "use"
    assert short(early.winner) == "default"
    assert "did not arrive" in early.reason
    assert early.waited_s >= TIMEOUT_S * 0.9
    assert late.waited_s < 1.0  # it read the decision instead of starting a wait
    assert max(r.wall_s for r in results) < TIMEOUT_S + 2 * COMPILE_MARGIN_S


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


@pytest.mark.parametrize("device", DEVICES)
def test_rank_that_never_tunes_the_op(device):
    results = run_ranks(2, never_tunes_body, device=device)
    (tuned,), untouched = assert_all_ok(results)
    assert untouched == []
    assert tuned.decision == "use" and short(tuned.winner) == "default"
    assert max(r.wall_s for r in results) < TIMEOUT_S + COMPILE_MARGIN_S


# -- a choice that cannot be built on one rank -----------------------------------------------


def unbuildable_body(r: Rank) -> list:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        ops.all_reduce_then("unbuildable", before=lambda x: ops.lowering_fails_on_rank(x, 1)),
        ops.reduce_scatter_all_gather,
    )
    group = r.group.group_name
    with patched_timeout(30.0):
        return compile_and_check(lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device))


@pytest.mark.parametrize("device", DEVICES)
def test_choice_that_cannot_be_built_on_one_rank_is_dropped_everywhere(device):
    (a,), (b,) = assert_all_ok(run_ranks(2, unbuildable_body, device=device))
    assert a == b and a.decision == "benchmark"
    assert "dropped unbuildable (group rank 1: does not build" in a.reason
    assert "planted lowering failure on rank 1" in a.reason
    assert {short(t.name) for t in a.timings} - {"default"} == {
        "one_all_reduce",
        "reduce_scatter_all_gather",
    }


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
        return compile_and_check(lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device))


@pytest.mark.parametrize("device", DEVICES)
def test_choice_raising_at_run_time_on_one_rank_stops_every_rank_clearly(device):
    results = run_ranks(2, planted_fault_body, "raises", device=device, breaks_the_group=True)
    for result in results:
        assert result.error is not None, f"rank {result.rank} went on: {result.value}"
        assert "CollectiveAutotuneError" in result.error
        assert "raises" in result.error, result.error  # the choice
        assert "planted failure on rank 1" in result.error, result.error  # the failing rank's report
        assert result.wall_s < 2 * TIMEOUT_S + COMPILE_MARGIN_S


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


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_compiling_different_ops_at_the_same_point(device):
    results = run_ranks(2, non_spmd_body, device=device)
    first, second = assert_all_ok(results)
    # Each rank waited once, alone, and fell back; the other rank's later compile of
    # that shape followed that decision of the group, without waiting.
    assert first.keys() == second.keys() and len(first) == 2
    for key in first:
        assert first[key] == second[key] and first[key].winner == "default"
    assert sorted(rec.waited_s > TIMEOUT_S * 0.9 for rec in [*first.values(), *second.values()]) == [
        False, False, True, True
    ]
    assert max(r.wall_s for r in results) < 2 * TIMEOUT_S + COMPILE_MARGIN_S


# -- two groups tuning concurrently, one starting late ----------------------------------------------


def two_groups_one_late_body(r: Rank, delay_s: float) -> list:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[r.rank // 2]
    register_two_choices()
    if r.rank >= 2:
        time.sleep(delay_s)
    with patched_timeout():
        return compile_and_check(lambda x: ops.all_reduce(x, mine.group_name), torch.randn(8, 8, device=r.device))


@pytest.mark.parametrize("device", DEVICES)
def test_two_groups_tuning_concurrently_one_starting_late(device):
    per_rank = assert_all_ok(run_ranks(4, two_groups_one_late_body, 2 * TIMEOUT_S, device=device))
    (a0,), (a1,), (b0,), (b1,) = per_rank
    assert a0 == a1 and b0 == b1
    assert a0.decision == b0.decision == "benchmark"
    # The punctual group never waited on the late one.
    assert a0.waited_s < TIMEOUT_S and a1.waited_s < TIMEOUT_S


# -- a rank killed mid-session ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_rank_killed_mid_session(device):
    survivor, dead = run_ranks(2, planted_fault_body, "dies", device=device, breaks_the_group=True)
    assert dead.wall_s is None  # it never reported
    assert survivor.error is not None and "CollectiveAutotuneError" in survivor.error
    assert "dies" in survivor.error, survivor.error  # the choice it was running
    assert survivor.wall_s < 2 * TIMEOUT_S + COMPILE_MARGIN_S


# -- stress: 20 sessions, random arrivals ------------------------------------------------------------------


STRESS_SESSIONS = 20
STRESS_TIMEOUT_S = 2.0


def stress_body(r: Rank, seed: int) -> list:
    register_two_choices()
    group = r.group.group_name
    rng = random.Random(seed * 1000 + r.rank)

    def fn(x):
        return ops.all_reduce(x, group) + 1

    with patched_timeout(STRESS_TIMEOUT_S), torch._dynamo.config.patch(recompile_limit=64):
        for i in range(STRESS_SESSIONS):
            time.sleep(rng.uniform(0, 2 * STRESS_TIMEOUT_S))
            compile_and_check(fn, torch.randn(8 * (i + 1), 8, device=r.device))
    return collective_autotune_records()[-STRESS_SESSIONS:]


def test_stress_twenty_sessions_with_random_arrivals():
    results = run_ranks(2, stress_body, 7, timeout_s=600)
    a, b = assert_all_ok(results)  # zero hangs
    assert len(a) == len(b) == STRESS_SESSIONS
    assert a == b  # zero disagreements
    # Each session either timed its key with the whole group or fell back, for this job only.
    assert all(rec.decision == "benchmark" or (rec.winner == "default" and rec.provisional) for rec in a), a


# -- bad configuration fails at once -----------------------------------------------------------------------


def bad_config_body(r: Rank, patch: dict, group: str) -> None:
    ops.register_all_reduce(ops.all_reduce_then("one_all_reduce"), ops.chunked_all_reduce)
    with torch._inductor.config.patch(patch):
        compile_and_check(lambda x: ops.all_reduce(x, group or r.group.group_name), torch.randn(8, 8))


@pytest.mark.parametrize(
    "patch,group,message",
    [
        ({"collective_benchmark_timeout": 0}, "", "collective_benchmark_timeout=0: seconds, > 0"),
        ({"collective_benchmark_nruns": 0}, "", "collective_benchmark_nruns=0: an int >= 1"),
        ({"collective_benchmark_mode": "fast"}, "", "collective_benchmark_mode='fast'"),
        ({}, "no_such_group", "names process group 'no_such_group'"),
    ],
)
def test_bad_configuration_fails_at_once(patch, group, message):
    (result,) = run_ranks(1, bad_config_body, patch, group)
    assert result.error is not None and message in result.error
    assert result.wall_s < COMPILE_MARGIN_S


def test_unparsable_environment_value_names_the_variable():
    env = {**os.environ, "TORCHINDUCTOR_COLLECTIVE_BENCHMARK_NRUNS": "many"}
    done = subprocess.run(
        [sys.executable, "-c", "import torch._inductor.config"], env=env, capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "TORCHINDUCTOR_COLLECTIVE_BENCHMARK_NRUNS='many' is not a valid int" in done.stderr


# -- ranks with different compile histories -------------------------------------------------------


def different_histories_body(r: Rank) -> list:
    ops.register_standard_ops()
    group = r.group.group_name
    if r.rank == 0:
        # Inductor numbers subgraph choices with a process-wide counter: this
        # compile, on rank 0 alone, shifts rank 0's numbers.
        compile_and_check(lambda x: ops.scale(x) + 1, torch.randn(8, 8, device=r.device))
    return compile_and_check(lambda x: ops.all_reduce(x, group), torch.randn(8, 8, device=r.device))


@pytest.mark.parametrize("device", DEVICES)
def test_ranks_with_different_compile_histories_still_tune_together(device):
    (a,), (b,) = assert_all_ok(run_ranks(2, different_histories_body, device=device))
    assert a == b and a.decision == "benchmark"


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
            compile_and_check(lambda t: ops.all_reduce(t, group), x)  # alone: falls back
        else:
            ops.all_reduce(x, group)  # the eager calls that pair with rank 0's
            ops.all_reduce(x, group)
        phases["alone"] = collective_autotune_records()[start:]
        # Both compile that op: the group decided it (rank 0's fallback), so neither
        # waits (rank 0 may even load the graph from its cache).
        torch._dynamo.reset()
        member = collective_protocol._participant  # rank 1 has none yet: it only ran eager
        waited_before = member.waited_s if member is not None else 0.0
        phases["same"] = compile_and_check(lambda t: ops.all_reduce(t, group), x)
        # Every wait of the protocol in that compile, the sessions' and any other.
        phases["same_waited_s"] = collective_protocol._participant.waited_s - waited_before
        # A new shape: the group meets in one session and tunes it together.
        torch._dynamo.reset()
        phases["new"] = compile_and_check(lambda t: ops.all_reduce(t, group) + 1, y)
    return phases


@pytest.mark.parametrize("device", DEVICES)
def test_rank_that_tuned_alone_does_not_stall_later_sessions(device):
    first, second = assert_all_ok(run_ranks(2, tuned_alone_body, device=device))
    (alone,) = first["alone"]
    assert alone.decision == "use" and alone.winner == "default" and second["alone"] == []
    # Rank 1 follows the group's decision without a wait of its own.
    (same,) = second["same"]
    assert same.winner == "default" and same.waited_s < 1.0
    assert all(rec.winner == "default" for rec in first["same"])
    assert second["same_waited_s"] < 1.0
    (new0,), (new1,) = first["new"], second["new"]
    assert new0 == new1 and new0.decision == "benchmark"


# -- waits bound silence, not work ----------------------------------------------------------------


LIVENESS_TIMEOUT_S = 5.0
# Longer than three timeouts: no wait may end while the cold rank works.
SLOW_TRACE_S = 16.0


def vote_after_body(r: Rank, works: bool) -> dict:
    """Rank 1 votes 3 s late, working (beating) meanwhile or silent; the timeout is 1 s."""
    from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError, CollectiveSession, participant

    member = participant(1.0)
    session = CollectiveSession(
        member, r.group.group_name, f"vote_after/{works}", r.rank, dist.get_process_group_ranks(r.group),
        timeout=1.0,
    )
    begin = time.monotonic()
    if r.rank == 1:
        with member.liveness.working("working on purpose") if works else contextlib.nullcontext():
            time.sleep(3.0)
    try:
        session.vote("late", "ok")
        return {"error": None, "s": time.monotonic() - begin}
    except CollectiveAutotuneError as e:
        return {"error": str(e), "s": time.monotonic() - begin}


@pytest.mark.parametrize("works", [True, False])
def test_a_vote_waits_for_a_working_peer_and_not_for_a_silent_one(works):
    early, late = assert_all_ok(run_ranks(2, vote_after_body, works))
    assert late["error"] is None
    if works:
        assert early["error"] is None and early["s"] > 2.5
    else:
        assert "late: group ranks [1] did not report and were silent for 1 s" in early["error"]
        # Under torchrun, rank 1 beat in earlier tests: then it says where, long ago.
        assert "group rank 1 never reported progress" in early["error"] or "group rank 1 was last heard" in early["error"]
        from torch.distributed._store_session import look_interval

        assert early["s"] < 1.0 + look_interval(1.0) + 0.25


def warm_cold_body(r: Rank) -> list:
    # Three choices that all lose to the op's own implementation by 20 ms: one winner,
    # whatever the noise of a loaded machine.
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce", "20"),
        ops.slow_to_trace("slow_to_trace", "20"),
        ops.all_reduce_then("another_all_reduce", "20"),
    )
    with patched_timeout(LIVENESS_TIMEOUT_S):
        return compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name) + 1, torch.randn(8, 8, device=r.device))


def test_a_cold_rank_compiling_longer_than_the_timeout_is_waited_for(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "{rank}")}
    (first,), _ = assert_all_ok(run_ranks(2, warm_cold_body, env=env, restarts=True))
    shutil.rmtree(tmp_path / "1")  # rank 1 cold; rank 0 warm
    slow = {**env, "CAT_TEST_SLOW_TRACE_RANK": "1", "CAT_TEST_SLOW_TRACE_S": str(SLOW_TRACE_S)}
    results = run_ranks(2, warm_cold_body, env=slow, restarts=True)
    (warm,), (cold,) = assert_all_ok(results)
    # The warm rank waited (its cache hit, then its votes) through the cold rank's
    # compile, over three timeouts long, and both tuned together.
    assert results[0].wall_s > SLOW_TRACE_S
    assert warm == cold and warm.source == "benchmark"
    assert warm.winner == first.winner == "default"


def dies_while_building_body(r: Rank, dying: int) -> dict:
    # Group rank ``dying`` dies while building its choices, once its peer waits for it.
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"),
        ops.all_reduce_then("dies_when_built", before=lambda x: ops.dies_when_lowered_on_rank(x, dying)),
    )
    try:
        with patched_timeout():
            compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name), torch.randn(8, 8, device=r.device))
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return {"error": f"{type(e).__name__}: {e}", "failed_at": time.time()}
    return {"error": None}


def test_a_rank_killed_while_its_peers_wait_for_it_fails_them_within_the_timeout(tmp_path):
    death = tmp_path / "died_at"
    survivor, dead = run_ranks(
        2, dies_while_building_body, 1, env={"CAT_TEST_DEATH_FILE": str(death)}, breaks_the_group=True
    )
    assert dead.wall_s is None  # it never reported
    assert survivor.ok and survivor.value["error"] is not None, survivor
    error = survivor.value["error"]
    # Nothing stored: the ranks build the site's choices before its one vote, which waits.
    assert "CollectiveAutotuneError: site/" in error and ": group ranks [1] did not report" in error, error
    assert "group rank 1 was last heard" in error and "compiling the choices of site/" in error, error
    from torch.distributed._store_session import look_interval

    # Within the timeout and one look interval of silence (see the docs' fault table).
    assert survivor.value["failed_at"] - float(death.read_text()) < TIMEOUT_S + look_interval(TIMEOUT_S) + 2.0


# -- a choice that reads a collective's output before waiting: Inductor waits there ----------------


def reads_before_wait_body(r: Rank) -> list:
    ops.register_all_reduce(ops.all_reduce_then("one_all_reduce"), ops.reads_before_wait)
    return compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name), torch.randn(64, 64, device=r.device))


def test_a_choice_reading_a_collective_before_waiting_is_waited_for_and_timed_on_every_rank():
    (a,), (b,) = assert_all_ok(run_ranks(2, reads_before_wait_body))  # compiled == eager
    assert a == b  # the same decision, and the same words, on every rank
    assert a.decision == "benchmark", a
    assert {short(t.name): t.status for t in a.timings}["reads_before_wait"] == "ok", a


def test_a_screen_rejection_names_each_rank_and_its_error():
    from torch._inductor.runtime.collective_benchmarking import _rejection

    wrong = "rejected: output differs from the reference (max abs error 7.95)"
    assert _rejection([wrong, "ok"]) == (
        f"rejected by group ranks [0] (group rank 0: {wrong}), accepted by group ranks [1]: a "
        "result that differs between ranks suggests it reads data before a collective completed"
    )
    assert _rejection([wrong, wrong]) == f"rejected by every rank: group rank 0: {wrong}; group rank 1: {wrong}"


# -- kept decisions are checked ---------------------------------------------------------------------


# Decisions on disk, compiled graphs not (unless a test turns them on).
NO_GRAPH_CACHES = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}


def zeroes_body(r: Rank) -> list:
    ops.register_all_reduce(ops.all_reduce_then("one_all_reduce", "20"), ops.zeroes)
    with patched_timeout(30.0):
        return compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name, "12"), torch.randn(8, 8, device=r.device))


def decision_files(root, rank: int) -> list:
    return sorted((root / str(rank) / "collective_autotuning" / "decisions").glob("*.json"))


def test_an_edited_decision_file_is_screened_and_never_runs_a_wrong_choice(tmp_path):
    import json

    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "{rank}"), **NO_GRAPH_CACHES}
    (first,), _ = assert_all_ok(run_ranks(2, zeroes_body, env=env, restarts=True))
    assert first.winner == "default" and first.source == "benchmark"
    for rank in (0, 1):  # every rank's file now names the rejected choice
        (entry,) = decision_files(tmp_path, rank)
        data = json.loads(entry.read_text())
        data["winner"] = "zeroes"
        entry.write_text(json.dumps(data))
    (again,), (peer,) = assert_all_ok(run_ranks(2, zeroes_body, env=env, restarts=True))
    # compile_and_check compared the outputs with eager: nothing wrong ran.
    assert again == peer and again.source == "benchmark" and again.winner == "default"
    assert "the stored winner failed its screen" in again.reason, again.reason


def changed_choice_body(r: Rank, variant: str) -> list:
    # "candidate" wins by 12 ms; between the two runs its code changes under the same name
    # (a bug that halves the sum).
    halve = (lambda x: x * 0.5) if variant == "buggy" else None
    ops.register_all_reduce(ops.all_reduce_then("candidate", before=halve), ops.all_reduce_then("slow", "20"))
    return compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name, "12") + 1, torch.randn(8, 8, device=r.device))


@pytest.mark.parametrize("graph_caches", [False, True])
def test_a_choice_whose_code_changed_is_tuned_afresh(tmp_path, graph_caches):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "{rank}"), **({} if graph_caches else NO_GRAPH_CACHES)}
    (first,), _ = assert_all_ok(run_ranks(2, changed_choice_body, "right", env=env, restarts=True))
    assert first.winner == "candidate"
    (again,), (peer,) = assert_all_ok(run_ranks(2, changed_choice_body, "buggy", env=env, restarts=True))
    # A new key (neither the stored decision nor the cached graph is used), tuned afresh:
    # the buggy candidate fails its screen. compile_and_check found the outputs right.
    assert again == peer and again.source == "benchmark" and again.key != first.key
    assert again.winner != "candidate"
    status = {t.name: t.reason for t in again.timings}
    assert "output differs from the reference" in status["candidate"], status


def writes_input_body(r: Rank) -> list:
    ops.register_all_reduce(ops.writes_into_input, ops.all_reduce_then("slow", "20"))
    x = torch.randn(8, 8, device=r.device)
    before = x.clone()
    records = compile_and_check(lambda t: ops.all_reduce(t, r.group.group_name, "12"), x)
    assert torch.equal(x, before), "the user's tensor changed"
    return records


def test_a_choice_that_writes_into_its_input_is_dropped():
    (a,), (b,) = assert_all_ok(run_ranks(2, writes_input_body))
    assert a == b and a.winner != "writes_into_input"
    # Found in its traced graph, on every rank alike: never timed, never inlined.
    assert (
        "dropped writes_into_input (group ranks [0, 1]: writes into input 0 (aten::copy_), which the op "
        "does not declare it mutates)" in a.reason
    ), a.reason
    assert "writes_into_input" not in {t.name for t in a.timings}


def test_the_screen_rejects_a_call_that_wrote_into_an_input():
    from torch._inductor.runtime.collective_benchmarking import _verdict, ScreenInputs, Verdict

    x = torch.ones(4)
    inputs = ScreenInputs([x])
    x.add_(1)  # what a call did to its input
    assert _verdict(x, x, inputs.written()) == (float(Verdict.WROTE_INPUT), 0.0)
    inputs.reset()
    assert inputs.written() is None and torch.equal(x, torch.ones(4))
    declared = ScreenInputs([x], mutable=[0])  # the op says it writes into input 0
    x.add_(1)
    assert declared.written() is None


# -- every call bounded ------------------------------------------------------------------------------


def slow_everywhere_body(r: Rank) -> list:
    # Each call of "stuck" takes 6 s on every rank; the budget is 2 s per choice.
    ops.register_all_reduce(ops.all_reduce_then("stuck", "6000"), ops.all_reduce_then("one_all_reduce"))
    with patched_timeout(2.0):
        return compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name), torch.randn(8, 8, device=r.device))


def test_a_choice_slow_on_every_rank_is_dropped_after_one_call():
    results = run_ranks(2, slow_everywhere_body)
    (a,), (b,) = assert_all_ok(results)
    assert a == b and a.winner != "stuck"
    status = {t.name: t.reason for t in a.timings}
    assert status["stuck"].startswith("over budget: its first call took 6"), status
    assert "collective_benchmark_timeout=2 s" in status["stuck"]
    # One call of it, not one per sample.
    assert max(r.wall_s for r in results) < 6.0 + COMPILE_MARGIN_S


def slow_on_one_rank_body(r: Rank) -> dict:
    # "stuck" takes 8 s on rank 1 only: rank 0 gives up waiting for it in the next barrier.
    ops.register_all_reduce(ops.all_reduce_then("stuck", "0,8000"), ops.all_reduce_then("one_all_reduce"))
    begin = time.monotonic()
    try:
        with patched_timeout(2.0):
            compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name), torch.randn(8, 8, device=r.device))
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - begin}
    return {"error": None, "s": time.monotonic() - begin}


def test_a_choice_stuck_on_one_rank_stops_every_rank_clearly():
    fast, stuck = assert_all_ok(run_ranks(2, slow_on_one_rank_body, breaks_the_group=True))
    for result in (fast, stuck):
        assert result["error"] is not None and "CollectiveAutotuneError" in result["error"], result
    # The stuck rank learns it when its call returns, at once.
    assert "stopped on every rank of the group" in stuck["error"], stuck["error"]
    assert stuck["s"] < 8.0 + COMPILE_MARGIN_S


# -- the Store -----------------------------------------------------------------------------------------


def switched_off_body(r: Rank) -> dict:
    import threading

    register_two_choices()
    store = dist.distributed_c10d._get_default_store()
    keys = store.num_keys()
    records = compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name), torch.randn(8, 8, device=r.device))
    dist.barrier()
    return {
        "records": records,
        "new_keys": store.num_keys() - keys,
        "participant": collective_protocol._participant is not None,
        "threads": [t.name for t in threading.enumerate() if "collective" in t.name],
    }


def test_switched_off_the_patch_uses_no_store_and_no_thread():
    off = {"TORCHINDUCTOR_COLLECTIVE_AUTOTUNE": "0"}
    a, b = assert_all_ok(run_ranks(2, switched_off_body, env=off, fresh_processes=True))
    for result in (a, b):
        (record,) = result["records"]
        assert record.winner == "default" and record.session == ""
        assert result["new_keys"] == 0 and not result["participant"] and result["threads"] == [], result


def test_losing_the_store_mid_session_is_reported_as_such(tmp_path):
    # Rank 0, which hosts the Store, dies; rank 1 waits for it in the build vote.
    dead, survivor = run_ranks(
        2, dies_while_building_body, 0, env={"CAT_TEST_DEATH_FILE": str(tmp_path / "died")}, breaks_the_group=True
    )
    assert dead.wall_s is None and survivor.ok, survivor
    error = survivor.value["error"]
    assert error is not None and "StoreLostError: the c10d Store (127.0.0.1:" in error, error
    assert "stopped answering during the vote on site/" in error, error


# -- settings that differ between ranks ------------------------------------------------------------


def differing_knob_body(r: Rank, knob: str, values: tuple) -> dict:
    register_two_choices()
    begin = time.monotonic()
    try:
        with patched_timeout(), torch._inductor.config.patch({knob: values[r.rank]}):
            compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name), torch.randn(8, 8, device=r.device))
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        return {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - begin}
    return {"error": None, "s": time.monotonic() - begin}


@pytest.mark.parametrize(
    "knob,values",
    [
        ("collective_benchmark_warmup", (5, 6)),
        ("collective_benchmark_sample_us", (1000.0, 5000.0)),
        ("collective_benchmark_nruns", (3, 20)),
    ],
)
def test_settings_that_differ_between_ranks_fail_every_rank_naming_the_variable(knob, values):
    results = assert_all_ok(run_ranks(2, differing_knob_body, knob, values))
    for result in results:
        assert result["error"] is not None and "CollectiveAutotuneError" in result["error"], result
        assert f"TORCHINDUCTOR_{knob.upper()}" in result["error"], result["error"]
        assert f"{values[0]!r} on group ranks [0]" in result["error"], result["error"]
        assert result["s"] < COMPILE_MARGIN_S


# -- a fallback holds for its job attempt only -----------------------------------------------------


def late_then_on_time_body(r: Rank, late: bool) -> list:
    register_two_choices()
    late_rank = 1 if late else None
    with arriving_after_the_decision(r, late_rank, f"late_then_on_time/{collective_protocol.attempt_namespace()}"), patched_timeout():
        return compile_and_check(lambda x: ops.all_reduce(x, r.group.group_name), torch.randn(8, 8, device=r.device))


def test_a_graph_inlining_a_fallback_is_not_loaded_by_the_next_job(tmp_path):
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "{rank}")}  # the FX-graph cache on
    (fallback,), _ = assert_all_ok(run_ranks(2, late_then_on_time_body, True, env=env, restarts=True))
    assert fallback.winner == "default" and fallback.provisional and "did not arrive" in fallback.reason
    (next_job,), (peer,) = assert_all_ok(run_ranks(2, late_then_on_time_body, False, env=env, restarts=True))
    assert next_job == peer and next_job.source == "benchmark" and not next_job.provisional


def elastic_attempt(restart_count: int):
    """The environment torchrun gives one attempt of an elastic job (whose attempts
    share one Store)."""
    return environment({"TORCHELASTIC_RUN_ID": "test_attempts", "TORCHELASTIC_RESTART_COUNT": str(restart_count)})


def restarted_attempt_body(r: Rank) -> dict:
    with elastic_attempt(0):
        first = late_then_on_time_body(r, True)
    torch._dynamo.reset()
    with elastic_attempt(1):
        return {"first": first, "second": late_then_on_time_body(r, False)}


def test_a_restarted_attempt_does_not_inherit_the_fallback_of_the_first():
    a, b = assert_all_ok(run_ranks(2, restarted_attempt_body, env=NO_GRAPH_CACHES))
    (first,), (second,) = a["first"], a["second"]
    assert first.winner == "default" and first.provisional
    assert a["second"] == b["second"] and second.source == "benchmark"
