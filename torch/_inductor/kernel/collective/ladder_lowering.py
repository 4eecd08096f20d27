"""A dynamic call site's ladder, lowered through upstream's tuning of one range.

Upstream's range-based lowering (``custom_op._range_based_lowering_fn``) tunes each
range of a custom op at its top size with ``tune_range``. For a collective op it asks
:func:`tuned_ranges` first, which walks the ladder's probes through ``tune_range``
(ladder.walk says which) and returns the range each choice runs, for upstream to
inline or dispatch by size. While a probe is tuned, :func:`current_probe` tells the
hooks which one: its key is the site's with the probe's size and choices, never read
back from the range's generated name.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._inductor.kernel.collective import selection
from torch._inductor.kernel.collective.detection import op_name
from torch._inductor.kernel.collective.ladder import (
    assign,
    branches,
    given_ladder,
    Ladder,
    log_walk,
    Probe,
    TOLERANCE,
    walk,
)
from torch._inductor.kernel.collective.range_graphs import range_of_this_graph
from torch._inductor.kernel.collective.records import Measurement

log = logging.getLogger(__name__)

# Upstream's tuning of one range (first size, last size) at its last size: the
# winning implementation (custom_op.ImplConfig).
TuneRange = Callable[[int, float], Any]


@dataclasses.dataclass
class LadderTuning:
    """One call site's ladder as its lowering walks it."""

    ladder: Ladder
    tune_range: TuneRange
    # The ladder's call site, prepared at its first probe (None: not tuned collectively).
    site: selection.CallSite | None = None
    # Decisions of probes outside the size range this graph is compiled for, by size:
    # taken as the group made them, not lowered (None: not known yet).
    outside: dict[int, Measurement] | None = None
    # Upstream's implementation of each winner, as tune_range returned it.
    implementations: dict[str, Any] = dataclasses.field(default_factory=dict)

    def ranges(self) -> dict[Any, Any]:
        """Upstream's RangeBounds -> ImplConfig for the ladder, after its walk."""
        from torch._inductor.kernel.custom_op import RangeBounds

        measurements = walk(self.ladder, self._tuned)
        assert measurements is not None  # _tuned always measures
        log_walk(self.ladder, measurements)
        tops = branches(measurements, assign(measurements, TOLERANCE))
        if self.site is not None and all(m.measured for m in measurements):
            selection.keep_ladder(self.site, op_name(self.ladder.op), tops)
        ranges, start = {}, 1
        for top, choice in tops:
            ranges[RangeBounds(start, top)] = self.implementations[choice]
            start = int(top) + 1 if top != math.inf else start
        return ranges

    def _tuned(self, probe: Probe) -> Measurement:
        probing = Probing(probe, self)
        _probing.append(probing)
        try:
            implementation = self.tune_range(probe.start, probe.size)
        finally:
            _probing.pop()
        if probing.measurement is None:
            raise RuntimeError(
                f"{self.ladder.name}: the probe at size {probe.size} was lowered "
                "without a decision of the group"
            )
        self.implementations.setdefault(probing.measurement.winner, implementation)
        return probing.measurement

    def probe_site(
        self,
        probe: Probe,
        name: str,
        prepare: Callable[[], selection.CallSite | None],
    ) -> selection.CallSite | None:
        """``probe``'s call site, lowered as ``name``; the ladder's site is prepared
        (``prepare``) at its first probe. None where it is not tuned collectively."""
        if self.site is None:
            self.site = prepare()
        if self.site is None:
            return None
        return self.site.probe(name, probe.size, probe.choices, probe.incumbent)

    def known_outside(self, probe: Probe) -> Measurement | None:
        """The group's decision at ``probe`` where its range lies outside the sizes
        this graph is compiled for and this rank holds every probe's decision; such a
        range is not lowered. None where it is lowered as usual."""
        if self.outside is None:
            self.outside = self._outside()
        return self.outside.get(probe.size)

    def _outside(self) -> dict[int, Measurement]:
        site = self.site
        assert site is not None

        def known(probe: Probe) -> Measurement | None:
            probed = site.probe("", probe.size, probe.choices, probe.incumbent)
            choice = selection.known_decision(probed)
            return None if choice is None else choice.measurement(probe.size)

        measurements = walk(self.ladder, known)
        if measurements is None:
            return {}
        tops = [
            top for top, _ in branches(measurements, assign(measurements, TOLERANCE))
        ]
        cell, _ = range_of_this_graph(self._size(site.inputs), tops)
        if cell is None:
            return {}
        outside, low = {}, 0.0
        for i, m in enumerate(measurements):
            high = math.inf if i == len(measurements) - 1 else m.size
            if not (cell.low <= low and high <= cell.high):
                outside[m.size] = m
            low = m.size
        log.debug(
            "%s: this graph is compiled for %s; ranges outside it are not lowered: %s",
            self.ladder.name,
            cell,
            sorted(outside),
        )
        return outside

    def _size(self, inputs: Sequence[Any]) -> Any:
        """The ladder's dynamic size among the call's tensor ``inputs``."""
        tensors = [
            a.name
            for a in self.ladder.op._schema.arguments
            if isinstance(a.type, torch.TensorType)
        ]
        return inputs[tensors.index(self.ladder.tensor_name)].get_size()[
            self.ladder.dim
        ]


@dataclasses.dataclass
class Probing:
    """A probe being lowered, and the group's decision once the hooks took it."""

    probe: Probe
    tuning: LadderTuning
    measurement: Measurement | None = None


_probing: list[Probing] = []


def current_probe() -> Probing | None:
    """The probe being lowered (upstream's autotune_custom_op is tuning it), or None."""
    return _probing[-1] if _probing else None


def tuned_ranges(
    name: str,
    op: torch._ops.OpOverload,
    ranges: Any,
    upper_bound: int,
    dispatch_on: tuple[str, int],
    tune_range: TuneRange,
) -> dict[Any, Any] | None:
    """For upstream's range-based lowering of op ``name``: the ranges of a collective
    op and their winners (RangeBounds -> ImplConfig), tuned by the group through
    ``tune_range``; None for other ops, which upstream tunes range by range.
    ``ranges`` is a dynamic ladder (hooks.dynamic_ladder) or the user's ranges."""
    ladder = (
        ranges
        if isinstance(ranges, Ladder)
        else given_ladder(name, op, dispatch_on, ranges, upper_bound)
    )
    if ladder is None:
        return None
    return LadderTuning(ladder, tune_range).ranges()
