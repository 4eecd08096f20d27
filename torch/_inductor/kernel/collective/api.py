"""Collective autotuning for users and serving engines: what to call, what to read.

Register an op's implementations with :func:`register_custom_op_autotuning` (upstream's)
and compile; under ``torchrun`` every rank of the op's process group tunes it in
lockstep. For a dimension of dynamic size, the sizes where winners change
(:func:`winner_change_points`) are kept with the decisions, so that an engine that
compiles per size range can read them before its first compile, on a warm start too;
:func:`warm_up_sizes` are the sizes to call a model at so that every range graph is
compiled before serving. :func:`collective_autotune_records` and
:func:`collective_autotune_size_paths` say what was decided, and how each site runs its
sizes.
"""

from __future__ import annotations

from typing import Any

from torch._inductor.kernel.collective.detection import op_name
from torch._inductor.kernel.custom_op import (  # upstream's registration API
    CustomOpConfig,
    register_custom_op_autotuning,
)
from torch._inductor.kernel.collective.ladder import warm_up_sizes
from torch._inductor.kernel.collective.records import (
    collective_autotune_records,
    collective_autotune_size_paths,
    CollectiveAutotuneRecord,
    format_record,
    SizePath,
    SizePathRecord,
)
from torch._inductor.runtime.collective_protocol import CollectiveAutotuneError


__all__ = [
    "CollectiveAutotuneError",
    "CollectiveAutotuneRecord",
    "CustomOpConfig",
    "SizePath",
    "SizePathRecord",
    "collective_autotune_records",
    "collective_autotune_size_paths",
    "format_record",
    "register_custom_op_autotuning",
    "warm_up_sizes",
    "winner_change_points",
]


def winner_change_points(op: Any = None) -> list[int]:
    """Ascending sizes after which a dynamic-size call site changes winner, of ``op``
    (an op, its packet, a ``torch.library.custom_op``, or "ns::name") or of every op:
    split points for an engine that compiles per size range.

    An op this process lowered gives its own points; any other, those kept with the
    decisions of earlier jobs in this environment for today's code, readable before
    anything compiles. Empty where none is known (the engine then compiles one range,
    which dispatches by size inside: right, only slower to start)."""
    from torch._inductor.kernel.collective.records import (
        winner_change_points as lowered_points,
    )

    wanted = None if op is None else _qualified(op)
    lowered = {p.op for p in collective_autotune_size_paths()}
    points = set(lowered_points(wanted))
    for ladder in _kept_ladders():
        if ladder.op not in lowered and wanted in (None, ladder.op):
            points.update(ladder.split_points)
    return sorted(points)


def _kept_ladders() -> list[Any]:
    """The ranges kept from earlier jobs that hold here: made with this torch on this
    kind of device, for the code each implementation has now."""
    import torch
    from torch._inductor import config
    from torch._inductor.kernel.collective.choices import current_identity
    from torch._inductor.runtime.collective_decisions import DecisionStore

    if not config.collective_autotune_persist or config.collective_autotune_retune:
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [
        ladder
        for ladder in DecisionStore().ladders()
        if ladder.environment.torch == torch.__version__
        and ladder.environment.device == device
        and all(current_identity(name) == code for name, code in ladder.code.items())
    ]


def _qualified(op: Any) -> str:
    """``op``'s qualified name, "ns::name"."""
    if isinstance(op, str):
        return op
    qualname = getattr(op, "_qualname", None)  # a torch.library.custom_op
    if isinstance(qualname, str):
        return qualname
    packet = getattr(op, "_qualified_op_name", None)  # an OpOverloadPacket
    return packet if isinstance(packet, str) else op_name(op)
