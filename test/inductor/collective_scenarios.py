"""What the fault scenarios share: the timeout they run under, the op they tune, and
explicit orderings of the ranks (a rank enters once its peers reached a point of their
session, told through the Store, instead of sleeping and hoping they did).
"""

from __future__ import annotations

import contextlib
import datetime
import unittest.mock
from collections.abc import Collection, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch._inductor.runtime import collective_protocol

import collective_ops as ops
from collective_harness import Rank


TIMEOUT_S = 4.0
# Compiling the choices on a loaded 2-core machine, before and after a session.
COMPILE_MARGIN_S = 60.0

# Decisions on disk, compiled graphs not (unless a test turns them on).
NO_GRAPH_CACHES = {
    "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
    "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
}


def patched_timeout(seconds: float = TIMEOUT_S):
    return torch._inductor.config.patch(collective_benchmark_timeout=seconds)


def register_two_choices() -> None:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"), ops.reduce_scatter_all_gather
    )


def decision_files(root: Path, rank: int) -> list[Path]:
    return sorted(
        (root / str(rank) / "collective_autotuning" / "decisions").glob("*.json")
    )


# The points of the punctual ranks' session a late rank can wait for.
JOINED = "joined"  # they entered it: they wait for the late rank, within the timeout
DECIDED = "decided"  # they left it decided, without the late rank (after the timeout)


@contextlib.contextmanager
def arriving_after(
    r: Rank, late_ranks: Collection[int], tag: str, moment: str | None = DECIDED
) -> Iterator[None]:
    """Each rank of ``late_ranks`` enters the block once every other rank of ``r``'s
    world reached ``moment`` (JOINED or DECIDED) of its first session in it; the others
    enter at once. ``moment`` None: every rank enters at once.

    A fixed head start for the punctual ranks is not enough: how long their compile
    takes to reach the session varies (up to 6 s on a loaded 2-core machine), and a
    late rank whose compile began before they gave up would keep their wait alive.
    ``tag`` names the scenario: its Store keys are its own.
    """
    if moment is None:
        yield
        return
    store = dist.distributed_c10d._get_default_store()
    key = f"test/{r.group.group_name}/{tag}/{moment}"
    if r.rank in late_ranks:
        store.wait([key], datetime.timedelta(seconds=COMPILE_MARGIN_S))
        yield
        return
    agree = collective_protocol.CollectiveSession.agree
    punctual = r.world_size - len(late_ranks)
    counted: list[str] = []

    def say(reached: str) -> None:
        """Count this rank at ``reached`` once; the last punctual rank there says so."""
        if reached != moment or counted:
            return
        counted.append(reached)
        if store.add(f"{key}/ranks", 1) == punctual:
            store.set(key, "1")

    def agree_and_say_so(session, *args, **kwargs):
        say(JOINED)
        decision = agree(session, *args, **kwargs)
        say(DECIDED)
        return decision

    with unittest.mock.patch.object(
        collective_protocol.CollectiveSession, "agree", agree_and_say_so
    ):
        yield


def arriving_after_the_decision(r: Rank, late_rank: int | None, tag: str):
    """Rank ``late_rank`` (None: no rank) enters the block once the other ranks'
    session has decided without it (they waited the timeout); the others at once."""
    return arriving_after(r, () if late_rank is None else (late_rank,), tag, DECIDED)
