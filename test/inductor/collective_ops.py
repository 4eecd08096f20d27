"""Custom ops for the collective autotuning tests, and implementations to choose from.

Each op's eager implementation is its default; the implementations registered for
autotuning are built by small factories so that each has a name of its own (a
CustomOpConfig parameter would also reach the default, which takes none).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._inductor.kernel.custom_op import (
    CustomOpConfig,
    register_custom_op_autotuning,
)


fc = torch.ops._c10d_functional


def group_of(group_name: str) -> dist.ProcessGroup:
    return torch._C._distributed_c10d._resolve_process_group(group_name)


def _per_rank(spec: str) -> float:
    """The value for this (global) rank in "a,b,c" (the last one repeats)."""
    values = [float(v) for v in spec.split(",")]
    return values[min(dist.get_rank(), len(values) - 1)]


def _gpu_cycles_per_ms() -> float:
    """The GPU's clock at its highest, as the benchmarker measures it for its sleeps
    (over-estimating only lengthens delays, which the tests bound from below)."""
    from torch._inductor.runtime.collective_benchmarking import _cycles_per_us

    return 1000 * _cycles_per_us(torch.cuda.current_device())


# -- ops ---------------------------------------------------------------------------


@torch.library.custom_op("cat_test::delay", mutates_args=())
def delay(x: torch.Tensor, ms: str) -> torch.Tensor:
    """``x``, after this rank's share of ``ms`` milliseconds (device time on GPU)."""
    _sleep_ms(x, _per_rank(ms))
    return x.clone()


@delay.register_fake
def _(x: torch.Tensor, ms: str) -> torch.Tensor:
    return torch.empty_like(x)


def _sleep_ms(x: torch.Tensor, ms: float) -> None:
    if x.is_cuda:
        torch.cuda._sleep(int(ms * _gpu_cycles_per_ms()))
    else:
        time.sleep(ms / 1e3)


# The tags of the implementations that ran (eagerly or inside a compiled graph).
ran: list[str] = []

# Per implementation, at each run of its Python body (that is, each time it is traced):
# how many collective decisions this process had recorded by then.
traced_at: dict[str, list[int]] = {}


def forget_runs() -> None:
    """Empties ``ran`` and ``traced_at``: a rank that runs several tests starts each
    as a spawned one does."""
    ran.clear()
    traced_at.clear()


def _note_trace(name: str) -> None:
    from torch._inductor.kernel.collective.api import collective_autotune_records

    traced_at.setdefault(name, []).append(len(collective_autotune_records()))


@torch.library.custom_op("cat_test::mark", mutates_args=())
def mark(x: torch.Tensor, tag: str) -> torch.Tensor:
    """``x``, noting that the implementation ``tag`` ran."""
    ran.append(tag)
    return x.clone()


@mark.register_fake
def _(x: torch.Tensor, tag: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::boundary", mutates_args=())
def boundary(x: torch.Tensor) -> torch.Tensor:
    """``x``: an op a serving engine splits its graph at (vLLM's attention)."""
    return x.clone()


@boundary.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out, group=group_of(group_name))
    return delay(out, delay_ms)


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
    return torch.empty_like(x)


def _all_reduce_context(ctx, inputs, output):  # type: ignore[no-untyped-def]
    ctx.group_name, ctx.delay_ms = inputs[1], inputs[2]


def _all_reduce_backward(ctx, grad):  # type: ignore[no-untyped-def]
    # Every rank's output is the sum of every rank's input: the gradient of a loss summed
    # over the ranks is the all-reduced gradient, a collective-tuned site of the backward.
    return all_reduce(grad, ctx.group_name, ctx.delay_ms), None, None


all_reduce.register_autograd(_all_reduce_backward, setup_context=_all_reduce_context)


@torch.library.custom_op("cat_test::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_name: str) -> torch.Tensor:
    group = group_of(group_name)
    out = x.new_empty((x.shape[0] * group.size(), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


@all_gather.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    size = group_of(group_name).size()
    return x.new_empty((x.shape[0] * size, *x.shape[1:]))


@torch.library.custom_op("cat_test::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, group_name: str) -> torch.Tensor:
    group = group_of(group_name)
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


@reduce_scatter.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    size = group_of(group_name).size()
    return x.new_empty((x.shape[0] // size, *x.shape[1:]))


@torch.library.custom_op("cat_test::opaque_all_reduce", mutates_args=())
def opaque_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """An all-reduce Inductor cannot see into (as symmetric-memory kernels are
    wrapped), noting that it ran."""
    out = x.clone()
    dist.all_reduce(out, group=group_of(group_name))
    ran.append("opaque")
    return out


@opaque_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@scale.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::grouped_scale", mutates_args=())
def grouped_scale(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` scaled by ``group``, a count of groups (as in group norm): no process
    group, whatever the argument's name."""
    return x * group


@grouped_scale.register_fake
def _(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::layout_scale", mutates_args=())
def layout_scale(x: torch.Tensor, group: str) -> torch.Tensor:
    """``x`` scaled as its layout ``group`` ("rows", else columns) says: a string
    that names no process group."""
    return x * (2 if group == "rows" else 3)


@layout_scale.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::laid_out_all_reduce", mutates_args=())
def laid_out_all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """An all-reduce over WORLD; ``group`` names a layout, not a process group."""
    out = x.clone()
    dist.all_reduce(out)
    return out


@laid_out_all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::fail_on_rank", mutates_args=())
def fail_on_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    if dist.get_rank() == rank:
        raise RuntimeError(f"cat_test::fail_on_rank: planted failure on rank {rank}")
    return x.clone()


@fail_on_rank.register_fake
def _(x: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::exit_on_rank", mutates_args=())
def exit_on_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    if dist.get_rank() == rank:
        os._exit(17)
    return x.clone()


@exit_on_rank.register_fake
def _(x: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("cat_test::lowering_fails_on_rank", mutates_args=())
def lowering_fails_on_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x.clone()


@lowering_fails_on_rank.register_fake
def _(x: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.empty_like(x)


def _register_failing_lowering() -> None:
    from torch._inductor.lowering import fallback_handler, register_lowering

    op = torch.ops.cat_test.lowering_fails_on_rank.default

    @register_lowering(op)
    def _lower(x, rank):  # type: ignore[no-untyped-def]
        if dist.get_rank() == rank:
            raise RuntimeError(f"planted lowering failure on rank {rank}")
        return fallback_handler(op, add_to_fallback_set=False)(x, rank)


_register_failing_lowering()


@torch.library.custom_op("cat_test::dies_when_lowered_on_rank", mutates_args=())
def dies_when_lowered_on_rank(x: torch.Tensor, rank: int) -> torch.Tensor:
    return x.clone()


@dies_when_lowered_on_rank.register_fake
def _(x: torch.Tensor, rank: int) -> torch.Tensor:
    return torch.empty_like(x)


def _register_dying_lowering() -> None:
    """On ``rank``, lowering the op kills the process once every other rank waits (its
    heartbeat went quiet for a look interval: this rank's own heartbeat has said what it
    does by then), writing the time of death to the file named
    by CAT_TEST_DEATH_FILE: a rank killed while compiling its choices."""
    from torch._inductor.lowering import fallback_handler, register_lowering

    op = torch.ops.cat_test.dies_when_lowered_on_rank.default

    @register_lowering(op)
    def _lower(x, rank):  # type: ignore[no-untyped-def]
        if dist.get_rank() == rank:
            _wait_until_peers_wait()
            with open(os.environ["CAT_TEST_DEATH_FILE"], "w") as f:
                f.write(repr(time.time()))
            os._exit(17)
        return fallback_handler(op, add_to_fallback_set=False)(x, rank)


def _wait_until_peers_wait(patience_s: float = 60.0) -> None:
    """Until WORLD's progress counter (which this rank, waiting here, does not beat) has
    not moved for a look interval (and a second): every peer waits for this rank, and
    this rank's heartbeat, which says what it does once a look, has said it."""
    from torch._inductor import config
    from torch._inductor.runtime.collective_protocol import participant
    from torch.distributed._store_session import look_interval, progress_key

    member = participant(config.collective_benchmark_timeout)
    quiet_s = max(1.0, look_interval(config.collective_benchmark_timeout) + 0.25)
    key = progress_key(member.namespace, dist.group.WORLD.group_name)
    last, quiet_since, give_up = None, time.monotonic(), time.monotonic() + patience_s
    with member.liveness.waiting():
        while time.monotonic() - quiet_since < quiet_s and time.monotonic() < give_up:
            beats = member.client.add(key, 0)
            if beats != last:
                last, quiet_since = beats, time.monotonic()
            time.sleep(0.05)


_register_dying_lowering()


# -- implementations -------------------------------------------------------------------


def all_reduce_then(
    name: str, wait_ms: str = "0", before: Callable | None = None
) -> Callable:
    """One all-reduce, optionally preceded by ``before(x)`` and followed by a delay."""

    def impl(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
        x = before(x) if before is not None else x
        out = fc.wait_tensor(fc.all_reduce(x, "sum", group_name))
        return out if wait_ms == "0" else delay(out, wait_ms)

    impl.__name__ = name
    return impl


def slow_to_trace(name: str) -> Callable:
    """An all-reduce whose tracing takes CAT_TEST_SLOW_TRACE_S seconds, once per
    process, on the global rank CAT_TEST_SLOW_TRACE_RANK: a cold compile."""

    def impl(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
        if (
            os.environ.get("CAT_TEST_SLOW_TRACE_RANK") == str(dist.get_rank())
            and not _slow_traced
        ):
            _slow_traced.append(name)
            # The fault under test: a compile that outlasts the timeout (no event to wait for).
            time.sleep(float(os.environ["CAT_TEST_SLOW_TRACE_S"]))
        return fc.wait_tensor(fc.all_reduce(x, "sum", group_name))

    impl.__name__ = name
    return impl


_slow_traced: list[str] = []


def reads_before_wait(
    x: torch.Tensor, group_name: str, delay_ms: str = "0"
) -> torch.Tensor:
    """Upstream's own test implementation: an in-place all-reduce whose output is read
    without wait_tensor, i.e. before the communication finished."""
    out = x.clone()
    fc.all_reduce_(out, "sum", group_name)
    return out * 1


def refuses_when_traced(name: str, ranks: str) -> Callable:
    """An all-reduce whose implementation raises while traced on ``ranks`` (global
    ranks, "0,2", or "all"), as a capability check would."""

    def impl(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
        if ranks == "all" or str(dist.get_rank()) in ranks.split(","):
            raise NotImplementedError(
                f"{name} is not supported on rank {dist.get_rank()}"
            )
        return fc.wait_tensor(fc.all_reduce(x, "sum", group_name))

    impl.__name__ = name
    return impl


def zeroes(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
    """Wrong and fast: no communication, zeros."""
    return torch.zeros_like(x)


def writes_into_input(
    x: torch.Tensor, group_name: str, delay_ms: str = "0"
) -> torch.Tensor:
    """The right sum, and fast, but left in its input too (the op declares no mutation)."""
    out = fc.wait_tensor(fc.all_reduce(x, "sum", group_name))
    x.copy_(out)
    return out


def flat_cost(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
    """An all-reduce whose cost does not grow with the size (DesignedCosts)."""
    return mark(fc.wait_tensor(fc.all_reduce(x, "sum", group_name)), "flat_cost")


def per_row_cost(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
    """An all-reduce whose cost grows with the rows (DesignedCosts)."""
    _note_trace("per_row_cost")
    return mark(fc.wait_tensor(fc.all_reduce(x, "sum", group_name)), "per_row_cost")


def per_row_cost_up_to_16(
    x: torch.Tensor, group_name: str, delay_ms: str = "0"
) -> torch.Tensor:
    """per_row_cost up to 16 rows, flat_cost above: it reads its size in Python, so a
    trace on symbolic sizes must guard it (upstream skips it from torch 2.13 on)."""
    if x.shape[0] <= 16:
        return per_row_cost(x, group_name)
    return flat_cost(x, group_name)


def opaque(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
    """The opaque op (DesignedCosts: faster than per_row_cost from 7 rows, than a 12 ms
    op's own below 120)."""
    return opaque_all_reduce(x, group_name)


def marked(name: str) -> Callable:
    """An all-reduce that notes that it ran, as ``name``, and costs nothing more: its
    cost is what the test gives (collective_harness.given_timings)."""

    def impl(x: torch.Tensor, group_name: str, delay_ms: str = "0") -> torch.Tensor:
        return mark(fc.wait_tensor(fc.all_reduce(x, "sum", group_name)), name)

    impl.__name__ = name
    return impl


@dataclasses.dataclass(frozen=True)
class DesignedCosts:
    """The given costs (collective_harness.given_timings) of the implementations
    above, in ms per call by rows: flat_cost 20, per_row_cost 1 a row (flat_cost above
    16 rows for per_row_cost_up_to_16), the opaque op 6 + 0.05 a row, the op's own
    ``own_ms``, any other choice 1."""

    own_ms: float = 12.0

    def __call__(self, choice: str, rows: int) -> float:
        ms = {
            "flat_cost": 20.0,
            "per_row_cost": float(rows),
            "per_row_cost_up_to_16": float(rows) if rows <= 16 else 20.0,
            "opaque": 6 + 0.05 * rows,
            "default": self.own_ms,
        }.get(choice, 1.0)
        return 1e3 * ms


def chunked_all_reduce(
    x: torch.Tensor, group_name: str, delay_ms: str = "0"
) -> torch.Tensor:
    return torch.cat(
        [fc.wait_tensor(fc.all_reduce(c, "sum", group_name)) for c in x.chunk(4)]
    )


def reduce_scatter_all_gather(
    x: torch.Tensor, group_name: str, delay_ms: str = "0"
) -> torch.Tensor:
    size = group_of(group_name).size()
    shard = fc.wait_tensor(
        fc.reduce_scatter_tensor(x.reshape(-1), "sum", size, group_name)
    )
    return fc.wait_tensor(fc.all_gather_into_tensor(shard, size, group_name)).view_as(x)


def all_gather_functional(x: torch.Tensor, group_name: str) -> torch.Tensor:
    size = group_of(group_name).size()
    return fc.wait_tensor(fc.all_gather_into_tensor(x, size, group_name))


def all_gather_by_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    # This rank's rows in place, zeros elsewhere, summed over the group.
    group = group_of(group_name)
    rows, rank = x.shape[0], dist.get_rank(group)
    full = torch.nn.functional.pad(
        x, (0, 0, rank * rows, (group.size() - rank - 1) * rows)
    )
    return fc.wait_tensor(fc.all_reduce(full, "sum", group_name))


def reduce_scatter_functional(x: torch.Tensor, group_name: str) -> torch.Tensor:
    size = group_of(group_name).size()
    return fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", size, group_name))


def reduce_scatter_by_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    group = group_of(group_name)
    rows = x.shape[0] // group.size()
    full = fc.wait_tensor(fc.all_reduce(x, "sum", group_name))
    return full[dist.get_rank(group) * rows : (dist.get_rank(group) + 1) * rows].clone()


def scaled_by_count(x: torch.Tensor, group: int) -> torch.Tensor:
    return x * group


def added_by_count(x: torch.Tensor, group: int) -> torch.Tensor:
    return sum([x] * group)


def scaled_by_layout(x: torch.Tensor, group: str) -> torch.Tensor:
    return x * (2 if group == "rows" else 3)


def added_by_layout(x: torch.Tensor, group: str) -> torch.Tensor:
    return x + x * (1 if group == "rows" else 2)


def laid_out_over_world(x: torch.Tensor, group: str) -> torch.Tensor:
    return fc.wait_tensor(fc.all_reduce(x, "sum", dist.group.WORLD.group_name))


def scale_by_mul(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def scale_by_add(x: torch.Tensor) -> torch.Tensor:
    return x + x


# -- registrations ---------------------------------------------------------------------


def register_all_reduce(*impls: Callable) -> None:
    register_custom_op_autotuning(
        all_reduce, configs=[CustomOpConfig(f) for f in impls]
    )


def register_standard_ops() -> None:
    """All-reduce, all-gather and reduce-scatter, each with genuinely different choices."""
    register_all_reduce(
        all_reduce_then("one_all_reduce"), chunked_all_reduce, reduce_scatter_all_gather
    )
    register_custom_op_autotuning(
        all_gather,
        configs=[
            CustomOpConfig(all_gather_functional),
            CustomOpConfig(all_gather_by_all_reduce),
        ],
    )
    register_custom_op_autotuning(
        reduce_scatter,
        configs=[
            CustomOpConfig(reduce_scatter_functional),
            CustomOpConfig(reduce_scatter_by_all_reduce),
        ],
    )
    register_custom_op_autotuning(
        scale, configs=[CustomOpConfig(scale_by_mul), CustomOpConfig(scale_by_add)]
    )
