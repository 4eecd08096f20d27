"""What a collective decision is for, and what one rank decided.

A decision is for a *key* (:func:`site_key`): the op, its inputs' sizes, strides and
dtypes, its choices, how they are timed, the threshold and what the call site fuses
with, as a short :func:`digest` that every rank computes alike. Each decision this
process makes or loads is kept as a :class:`CollectiveAutotuneRecord`
(:func:`collective_autotune_records`), and :func:`format_record` writes it as the table
that ``TORCH_LOGS=collective_autotuning`` prints.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Sequence, TYPE_CHECKING

import torch
from torch._inductor.runtime.collective_benchmarking import ChoiceTiming


if TYPE_CHECKING:
    from torch._inductor.kernel.collective_choice_modules import Neighbours


def digest(*parts: Any) -> str:
    """A short name for ``parts``, the same on every rank."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def site_key(
    name: str,
    inputs: Sequence[Any],
    labels: Sequence[str],
    mode: str,
    min_speedup_threshold: float,
    neighbours: Neighbours,
) -> str:
    """What a decision is for: the op (by its autotuning name), its inputs' sizes,
    strides and dtypes, its choices, how they are timed, the threshold, and what the
    site fuses with (the same op may win alone and lose between pointwise neighbours)."""
    return digest(
        name, [_node_meta(n) for n in inputs], tuple(labels), mode, min_speedup_threshold, str(neighbours)
    )


def _node_meta(node: Any) -> str:
    """Size, stride and dtype of an IR node or layout (not its device)."""
    if hasattr(node, "get_size"):
        return f"{node.get_size()}/{node.get_stride()}/{node.get_dtype()}"
    return f"{node.size}/{node.stride}/{node.dtype}"


@dataclasses.dataclass(frozen=True)
class CollectiveAutotuneRecord:
    """What one rank decided for one collective-tuned call site.

    Identical across the group but for the fields that say how long this rank took.
    """

    op: str
    group_name: str
    group_ranks: tuple[int, ...]
    # The decision's key (op, shapes, choices, timing mode) and the session it was
    # agreed in.
    key: str
    session: str
    # "benchmark" (timed now) or "use" (taken without timing), where the decision
    # came from ("benchmark", "job": decided earlier in this job, "disk": stored by
    # every rank, "cache": inlined in a cached graph every rank loaded, "ladder": the
    # winner of both neighbouring sizes of a dynamic op, "agreement": the group's
    # fallback or only choice), and why.
    decision: str
    source: str
    reason: str
    timings: tuple[ChoiceTiming, ...]
    # Choices are named by their implementation and parameters, e.g.
    # "chunked_all_reduce(chunks=4)"; the op's own implementation is "default".
    winner: str
    # How choices are (or would have been) timed: "graph" (CUDA graphs) or "eager",
    # and the pointwise neighbours each choice was timed with ("producer+consumer",
    # "none"; collective_choice_modules).
    mode: str = ""
    timed_with: str = ""
    # Seconds this rank waited for its peers (to arrive, to vote), spent compiling
    # choices, and spent otherwise on the decision (its own votes and the benchmark).
    waited_s: float = dataclasses.field(default=0.0, compare=False)
    build_s: float = dataclasses.field(default=0.0, compare=False)
    tuning_s: float = dataclasses.field(default=0.0, compare=False)


_records: list[CollectiveAutotuneRecord] = []


def collective_autotune_records() -> list[CollectiveAutotuneRecord]:
    """The decisions this process made so far, oldest first."""
    return list(_records)


def keep_record(record: CollectiveAutotuneRecord) -> None:
    """Add ``record`` to this process's decisions."""
    _records.append(record)


def note_cached_sites(sites: list[tuple[str, str, str, str, str]]) -> None:
    """Record the decisions inlined in a graph loaded from the cache: (group, plan,
    key, winner, op) of each of its collective-tuned keys."""
    import torch.distributed as dist

    for group_name, plan, key, winner, op in sites:
        group = torch._C._distributed_c10d._resolve_process_group(group_name)
        keep_record(
            CollectiveAutotuneRecord(
                op, group_name, tuple(dist.get_process_group_ranks(group)), key, plan, "use",
                "cache", "inlined in a compiled graph loaded from the cache; the group agrees", (),
                winner,
            )
        )


def format_record(record: CollectiveAutotuneRecord) -> str:
    """A table of one decision: choice, slowest- and fastest-rank time, winner."""
    lines = [
        f"collective autotuning: {record.op} on group {record.group_name} "
        f"(ranks {list(record.group_ranks)}), key {record.key}",
        f"  decision: {record.decision} ({record.source}); winner: {record.winner} "
        f"({record.reason})",
    ]
    if record.timed_with:
        lines.append(f"  timed with its pointwise neighbours: {record.timed_with}")
    if record.timings:
        width = max(len(t.name) for t in record.timings)
        lines.append(
            f"  {'choice':<{width}}  {'slowest rank us':>15}  {'fastest rank us':>15}  "
            f"{'calls/sample':>12}  {'samples':>7}  {'skew us':>7}  status"
        )
        for t in record.timings:
            mark = "  <- winner" if t.name == record.winner else ""
            lines.append(
                f"  {t.name:<{width}}  {t.max_us:>15.1f}  {t.min_us:>15.1f}  "
                f"{t.calls_per_sample:>12}  {t.samples:>7}  {t.skew_us:>7.1f}  {t.status}{mark}"
            )
    return "\n".join(lines)
