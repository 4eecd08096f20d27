"""Collective ops of dynamic size: the right implementation at every size, one compile.

The best all-reduce depends on the message size (one-shot for small messages,
two-shot in between, NCCL for the largest), and a serving model compiled once with a
dynamic token dimension sends all of them. When a collective op's first input has a
dynamic dimension and the user gave no split points, :func:`dynamic_ladder` gives
Inductor's range-based custom-op lowering a *ladder* of sizes along that dimension:
1, r, r^2, ... (``collective_autotune_dynamic_ratio``, default 4) up to the symbol's
upper bound, or ``collective_autotune_dynamic_max`` (default 16384) where the symbol
is unbounded. Each range (p_i-1, p_i] is decided at its top size, by the group, as a
key of its own (so it is reused in the job and kept on disk like any other); neighbour
ranges with one winner merge, and the generated code dispatches on the size at run
time (nested ``torch.cond`` on the dimension, inlined into the graph).

Ranges are tuned coarse to fine: the smallest and largest first, then the middle of
every gap. A range whose nearest decided neighbours below and above chose the same
implementation takes it without being timed (:func:`interpolated`); only the gaps
where the winner changes are timed at every point.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from typing import Any, Callable, Optional, Sequence

import sympy
import torch


log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Where one op call is tuned: sizes of one dimension of its first tensor input."""

    # The first tensor argument's name in the op's schema, and the dimension.
    tensor_name: str
    dim: int
    # Range tops in ascending order; the last range is unbounded.
    points: tuple[int, ...]
    upper_bound: int

    @property
    def ranges(self) -> list[tuple[int, float]]:
        """The ranges (start, end], in the order they are tuned: coarse to fine."""
        bounds = [(start, float(end)) for start, end in zip((1, *(p + 1 for p in self.points)), (*self.points, math.inf))]
        return [bounds[i] for i in _bisection_order(len(bounds))]


# The range names of each ladder in size order, by the range name of any of its points.
_ladders: dict[str, list[str]] = {}


def dynamic_ladder(name: str, op: Any, tensor_inputs: Sequence[Any]) -> Optional[Ladder]:
    """A ladder for this call of ``op`` if it is a collective op whose first input has
    a dynamic dimension; None where the op is tuned at one size."""
    import torch.distributed as dist
    from torch._inductor import config
    from torch._inductor.kernel.collective_autotuning import names_a_collective
    from torch._inductor.virtualized import V

    if not (
        config.collective_autotune
        and config.collective_autotune_dynamic
        and tensor_inputs
        and names_a_collective(op)
        and dist.is_available()
        and dist.is_initialized()
    ):
        return None
    size = tensor_inputs[0].get_size()
    dim = next((i for i, s in enumerate(size) if _is_symbolic(s)), None)
    if dim is None:
        return None
    _validate(config.collective_autotune_dynamic_ratio, config.collective_autotune_dynamic_max)
    bounds = V.graph.sizevars.shape_env.bound_sympy(size[dim])
    # Unbounded (torch's int_oo) unless the program bounded the dimension.
    upper = int(bounds.upper) if isinstance(bounds.upper, sympy.Integer) else config.collective_autotune_dynamic_max
    points = _points(config.collective_autotune_dynamic_ratio, upper)
    tensor_arguments = [a.name for a in op._schema.arguments if _is_tensor(a)]
    ladder = Ladder(tensor_arguments[0], dim, points, upper)
    names = [range_name(name, start, end) for start, end in sorted(ladder.ranges)]
    for n in names:
        _ladders[n] = names
    log.info(
        "%s has a dynamic size along dim %d of %s (up to %d): tuned at %s",
        name, dim, ladder.tensor_name, upper, [*points, upper],
    )
    return ladder


def range_name(name: str, start: int, end: float) -> str:
    """Inductor's name for one range of a range-based custom op."""
    return f"{name}_range_{int(start)}_{int(end) if end != math.inf else 'inf'}"


_RANGE_NAME = re.compile(r"_range_\d+_(\d+|inf)$")


def is_range(name: str) -> bool:
    """Whether ``name`` is Inductor's name for one range of a range-based custom op
    (ours or one with user-given split points)."""
    return bool(_RANGE_NAME.search(name))


def interpolated(name: str, decided: Callable[[str], Optional[str]]) -> Optional[tuple[str, str]]:
    """The winner of the ladder range ``name`` without timing it, and why: the common
    winner of its nearest decided neighbours below and above, when they agree.
    ``decided`` gives a range's decision by its name (None while undecided)."""
    names = _ladders.get(name)
    if names is None:
        return None
    i = names.index(name)
    below = next(((n, w) for n in reversed(names[:i]) if (w := decided(n)) is not None), None)
    above = next(((n, w) for n in names[i + 1:] if (w := decided(n)) is not None), None)
    if below is None or above is None or below[1] != above[1]:
        return None
    return below[1], f"the neighbouring sizes {_top(below[0])} and {_top(above[0])} chose it too"


def _validate(ratio: Any, largest: Any) -> None:
    problems = []
    if not (isinstance(ratio, int) and ratio >= 2):
        problems.append(f"collective_autotune_dynamic_ratio={ratio!r}: an int >= 2")
    if not (isinstance(largest, int) and largest >= 1):
        problems.append(f"collective_autotune_dynamic_max={largest!r}: an int >= 1")
    if problems:
        raise ValueError(
            "invalid collective autotuning configuration (torch._inductor.config or its "
            "TORCHINDUCTOR_* variable); expected " + "; ".join(problems)
        )


def _points(ratio: int, upper: int) -> tuple[int, ...]:
    points = []
    p = 1
    while p < upper:
        points.append(p)
        p *= ratio
    return tuple(points)


def _bisection_order(n: int) -> list[int]:
    """0, n-1, then the middle of every gap, level by level."""
    if n <= 2:
        return list(range(n))
    order, gaps = [0, n - 1], [(0, n - 1)]
    while gaps:
        following = []
        for lo, hi in gaps:
            if hi - lo > 1:
                mid = (lo + hi) // 2
                order.append(mid)
                following += [(lo, mid), (mid, hi)]
        gaps = following
    return order


def _top(range_name_: str) -> str:
    return range_name_.rsplit("_", 1)[-1]


def _is_symbolic(size: Any) -> bool:
    return bool(getattr(size, "free_symbols", None))


def _is_tensor(argument: Any) -> bool:
    return isinstance(argument.type, torch.TensorType)


def lowered_once(op: Any, lowering: Callable[..., Any]) -> Callable[..., Any]:
    """``lowering``, except where ``op`` is lowered inside its own lowering: there the op
    lowers as itself (a call of its eager kernel).

    A range's dispatch, or a range-based op whose every range chose the op's own
    implementation, traces that implementation, the op itself, into the graph; lowering
    it with ``lowering`` again would tune it again, without end. torch 2.13 guards every
    user lowering so; torch 2.11 registers autotuned ops as plain lowerings.
    """
    from torch._inductor.lowering import fallback_handler

    active = False

    @functools.wraps(lowering)
    def lower(*args: Any, **kwargs: Any) -> Any:
        nonlocal active
        if active:
            return fallback_handler(op, add_to_fallback_set=False)(*args, **kwargs)
        active = True
        try:
            return lowering(*args, **kwargs)
        finally:
            active = False

    return lower
