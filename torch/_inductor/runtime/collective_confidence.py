"""Whether a collective benchmark's pick is kept for good (*settled*) or re-timed by the
next job that meets it (*provisional*): eager readings taken on a busy host are not
trusted. Every input is identical on every rank, so every rank decides alike."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch._inductor.runtime.collective_benchmarking import (
    ChoiceStatus,
    ChoiceTiming,
    clearly_slower,
)

# Eager readings are distrusted above this much CPU wait per second of timing.
CONTENTION_LIMIT = 0.2


@dataclasses.dataclass(frozen=True)
class Confidence:
    """How far one decision's readings can be trusted; identical on every rank."""

    # "" where the winner was the only choice timed.
    runner_up: str = ""
    lead: float = math.inf
    spread: float = 0.0
    contention: float = 0.0
    settled: bool = True
    reason: str = ""

    def describe(self) -> str:
        if not self.runner_up:
            return "settled: the only choice timed"
        return (
            f"{'settled' if self.settled else 'provisional'}: {self.reason} (lead "
            f"over {self.runner_up} {100 * self.lead:+.1f}%, spread "
            f"{100 * self.spread:.1f}%, host contention {self.contention:.2f})"
        )


def judge(timings: Sequence[ChoiceTiming], winner: str, host_paced: bool) -> Confidence:
    """How far the pick of ``winner`` can be trusted; ``host_paced``: the host's timing
    entered the samples (eager timing)."""
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
        # Re-timing a near tie costs every restart and may flip numerics: kept.
        reason = (
            f"{winner} and {runner_up.name} are a near tie on a quiet host "
            "(quartiles overlap)"
        )
    else:
        reason = f"{winner} is clearly ahead on a quiet host"
    return Confidence(runner_up.name, lead, spread, contention, not loaded, reason)
