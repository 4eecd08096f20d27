"""How far a collective benchmark's readings can be trusted, and so a decision.

A benchmark taken while another process loads the host reads what that moment allowed:
on 2 gloo ranks of a 2-core machine with one busy process beside them, a choice whose
work is spread evenly over the ranks read up to twice its quiet time, and lost to one
that was slower by the slowest rank on a quiet machine. Such a pick must not be kept for
good. So every benchmark says how much its readings can be trusted:

* *lead*: how far the winner is ahead of the runner-up, as the samples show it: the
  runner-up's lower quartile over the winner's upper quartile, on their slowest ranks
  (the benchmark's own test for dropping a choice, :func:`clearly_slower`, asks
  :data:`DROP_MARGIN`);
* *spread*: the larger relative interquartile range of the two, on their slowest ranks;
* *contention*: the seconds per second the timing thread spent runnable but waiting
  for a CPU while a choice's samples were taken, on the group's most contended rank
  (collective_benchmarking.HostContention), for the more contended of winner and
  runner-up. Per choice: a busy process slows the choices whose ranks want a CPU at
  once and barely touches one whose ranks take turns, and a measure over every choice's
  samples averages the two; of the two compared, since a choice that is neither
  decides nothing (and the most contended of several, on a small host, is often one
  the job's own threads crowd).

A decision is *settled* when the host was quiet where it paces the samples (eager
timing: host-paced launches and CPU collectives; graph replays are enqueued behind a GPU
sleep and do not depend on the host's timing): a winner clearly ahead, or a near tie,
which either choice serves as well (timing it again at every restart would cost a
benchmark each time, and could flip between implementations whose numerics differ).
Otherwise it is *provisional*: used for the job, kept on disk as provisional, and
re-timed by the next job that meets it (winner against runner-up only), which settles
or replaces it. Every input is identical on every rank (one MAX all-reduce), so every
rank takes the same path.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch._inductor.runtime.collective_benchmarking import (
    ChoiceStatus,
    ChoiceTiming,
    clearly_slower,
)

# Above this many seconds per second that the timing thread of some rank spent runnable
# but waiting for a CPU while the winner or the runner-up was timed, eager readings are
# not trusted. Measured on 2 gloo ranks on 2 cores: quiet 0.01-0.12 (milliseconds of
# work per call) and 0.04-0.26 (microsecond collectives, woken thousands of times a
# second: a demo job's decision is provisional about one time in four there); one busy
# process beside them 0.28-0.45. A VM's stolen CPU time (/proc/stat's steal) is not
# counted: on that VM it read 0.28-0.51 of the host's CPU time whenever the two ranks
# timed their choices, and the jobs picked the same winner, 4 of 4 (a level of steal
# slows every choice; it does not say which readings it biased): counting it made
# every pick there provisional.
CONTENTION_LIMIT = 0.2


@dataclasses.dataclass(frozen=True)
class Confidence:
    """How far one decision's readings can be trusted; identical on every rank."""

    # The best choice other than the winner ("" where it was the only one timed).
    runner_up: str = ""
    # The runner-up's lower quartile over the winner's upper quartile, less 1.
    lead: float = math.inf
    # The larger relative interquartile range of winner and runner-up.
    spread: float = 0.0
    # Seconds per second the timing thread spent waiting for a CPU while the winner or
    # the runner-up was timed (the more contended), on the group's most contended rank.
    contention: float = 0.0
    settled: bool = True
    reason: str = ""

    def describe(self) -> str:
        """One clause for the logs."""
        if not self.runner_up:
            return "settled: the only choice timed"
        return (
            f"{'settled' if self.settled else 'provisional'}: {self.reason} (lead "
            f"over {self.runner_up} {100 * self.lead:+.1f}%, spread "
            f"{100 * self.spread:.1f}%, host contention {self.contention:.2f})"
        )


def judge(timings: Sequence[ChoiceTiming], winner: str, host_paced: bool) -> Confidence:
    """How far the pick of ``winner`` among ``timings`` can be trusted, given how
    contended the host was while each was timed; ``host_paced`` says whether the host's
    timing entered the samples (eager timing)."""
    timed = [
        t for t in timings if t.status is ChoiceStatus.OK and math.isfinite(t.max_us)
    ]
    best = next((t for t in timed if t.name == winner), None)
    others = sorted((t for t in timed if t.name != winner), key=lambda t: t.max_us)
    if best is None or not others:
        return Confidence(contention=best.contention if best is not None else 0.0)
    runner_up = others[0]
    contention = max(best.contention, runner_up.contention)
    lead = runner_up.low_us / best.high_us - 1 if best.high_us > 0 else math.inf
    spread = max(
        (t.high_us - t.low_us) / t.max_us for t in (best, runner_up) if t.max_us > 0
    )
    loaded = host_paced and contention > CONTENTION_LIMIT
    if loaded:
        reason = (
            f"the host was busy while the choices were timed (a rank's timing thread "
            f"waited for a CPU {1000 * contention:.0f} ms a second, over "
            f"{1000 * CONTENTION_LIMIT:.0f})"
        )
    elif not clearly_slower(runner_up.low_us, best.high_us):
        # Timing a near tie again would cost every restart a benchmark and could flip
        # between two equally fast choices, whose numerics may differ: kept.
        reason = (
            f"{winner} and {runner_up.name} are a near tie on a quiet host "
            "(quartiles overlap)"
        )
    else:
        reason = f"{winner} is clearly ahead on a quiet host"
    return Confidence(runner_up.name, lead, spread, contention, not loaded, reason)
