# Owner(s): ["module: inductor"]
"""Upstream's own collective-autotuning test patterns, with every rank's result checked.

Upstream's ``test/inductor/test_collective_autotuning.py`` registers ops whose
implementations call the in-place functional all-reduce and return (or scale) its result
without ``wait_tensor``, on a group registered under a name, and asserts only the output's
shape. Compiled, such a read races with the communication. Here the same patterns must
give every rank the all-reduced value: Inductor waits where the author did not, and the
choices are benchmarked like any other. Where the op's own implementation reads an
unwaited output inside its body, every rank stops with the same clear error.

Runs self-spawned under plain pytest (gloo; NCCL where GPUs are present) and under
``torchrun --nproc_per_node=N -m pytest`` (cases of another world size skip).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from collective_harness import assert_all_ok, Costs, DEVICE_CASES, Rank, run_ranks
from torch._inductor.kernel.collective.api import collective_autotune_records

_c10d = torch.ops._c10d_functional
_HAS_CUDA = torch.cuda.is_available()


def _named_group(r: Rank, tag: str) -> str:
    """Register the rank's group under a name of the test's own, as upstream's tests
    register WORLD as "default"."""
    from torch._C._distributed_c10d import _register_process_group

    name = f"conformance_{tag}"
    _register_process_group(name, r.group)
    return name


def _summed(r: Rank, x: torch.Tensor) -> torch.Tensor:
    """The all-reduced value of ``x``, computed apart from anything compiled."""
    gathered = [torch.empty_like(x) for _ in range(r.world_size)]
    dist.all_gather(gathered, x.contiguous(), group=r.group)
    return torch.stack(gathered).sum(0)


def _outcome(r: Rank, model: torch.nn.Module, x: torch.Tensor) -> dict:
    """The compiled model's largest error against the all-reduced input, and the
    decisions it made, on this rank."""
    start = len(collective_autotune_records())
    y = torch.compile(model)(x)
    error = (y - _summed(r, x)).abs().max().item()
    records = collective_autotune_records()[start:]
    return {
        "shape_ok": y.shape == x.shape,
        "error": error,
        "records": [(rec.key, rec.decision, rec.winner, rec.reason) for rec in records],
        "timed": [sorted((t.name, t.status) for t in rec.timings) for rec in records],
    }


def _unwaited_sum_op(name: str, group: str):
    """A custom op whose own implementation is upstream's: a copy all-reduced in place,
    returned without wait_tensor."""

    @torch.library.custom_op(f"conformance::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        result = x.clone()
        return _c10d.all_reduce_(result, "sum", group)

    @op.register_fake
    def _(x):
        return torch.empty_like(x)

    return op


# -- upstream's patterns -------------------------------------------------------------------


def equivalent_strategies_body(r: Rank, tag: str) -> dict:
    """Upstream's ``test_equivalent_allreduce_strategies``: sum, and avg times the world
    size, both in place and never waited for, as is the op's own implementation."""
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    group = _named_group(r, tag)
    world_size = r.world_size

    equiv_ar = _unwaited_sum_op(f"equiv_ar_{tag}", group)

    def sum_allreduce(x: torch.Tensor) -> torch.Tensor:
        result = x.clone()
        return _c10d.all_reduce_(result, "sum", group)

    def avg_allreduce_scaled(x: torch.Tensor) -> torch.Tensor:
        result = x.clone()
        result = _c10d.all_reduce_(result, "avg", group)
        return result * world_size

    register_custom_op_autotuning(
        equiv_ar,
        configs=[CustomOpConfig(sum_allreduce), CustomOpConfig(avg_allreduce_scaled)],
    )

    class EquivAllReduceModel(torch.nn.Module):
        def forward(self, x):
            return equiv_ar(x)

    torch.manual_seed(42 + r.rank)  # a different input on every rank
    return _outcome(r, EquivAllReduceModel(), torch.randn(128, 128, device=r.device))


def in_place_body(r: Rank, tag: str) -> dict:
    """The c10d docs' way to write a collective, in place on a copy: a choice like any
    other, timed and, where the given costs make it fastest, inlined."""
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    group = _named_group(r, tag)
    in_place_op = _unwaited_sum_op(f"in_place_{tag}", group)

    def dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(
            y, group=torch._C._distributed_c10d._resolve_process_group(group)
        )
        return y

    def functional(x: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))

    register_custom_op_autotuning(
        in_place_op,
        configs=[CustomOpConfig(dist_all_reduce), CustomOpConfig(functional)],
    )

    class Model(torch.nn.Module):
        def forward(self, x):
            return in_place_op(x)

    torch.manual_seed(11 + r.rank)
    return _outcome(r, Model(), torch.randn(32, 32, device=r.device))


def vllm_style_body(r: Rank, tag: str) -> dict:
    """Upstream's ``test_vllm_style_allreduce``: flatten, copy into a buffer, all-reduce
    it in place and reshape (vLLM's registered=False path), against a direct in-place
    all-reduce; neither waits."""
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    group = _named_group(r, tag)

    vllm_allreduce = _unwaited_sum_op(f"vllm_allreduce_{tag}", group)

    def vllm_buffer_copy_allreduce(x: torch.Tensor) -> torch.Tensor:
        original_shape = x.shape
        buffer_copy = x.contiguous().view(-1).clone()
        result = _c10d.all_reduce_(buffer_copy, "sum", group)
        return result.view(original_shape)

    def nccl_allreduce_direct(x: torch.Tensor) -> torch.Tensor:
        result = x.clone()
        return _c10d.all_reduce_(result, "sum", group)

    register_custom_op_autotuning(
        vllm_allreduce,
        configs=[
            CustomOpConfig(vllm_buffer_copy_allreduce),
            CustomOpConfig(nccl_allreduce_direct),
        ],
    )

    class VLLMAllReduceModel(torch.nn.Module):
        def forward(self, x):
            return vllm_allreduce(x)

    torch.manual_seed(42 + r.rank)
    return _outcome(r, VLLMAllReduceModel(), torch.randn(128, 256, device=r.device))


def own_reads_before_wait_body(r: Rank, tag: str) -> dict:
    """The op's own implementation reads the all-reduce's output before waiting, inside
    an opaque call that no wait from outside can mend: compiling it raises."""
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    group = _named_group(r, tag)

    @torch.library.custom_op(f"conformance::own_reads_{tag}", mutates_args=())
    def own_reads(x: torch.Tensor) -> torch.Tensor:
        result = x.clone()
        return _c10d.all_reduce_(result, "avg", group) * 2

    @own_reads.register_fake
    def _(x):
        return torch.empty_like(x)

    def waits(x: torch.Tensor) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(x, "avg", group)) * 2

    register_custom_op_autotuning(own_reads, configs=[CustomOpConfig(waits)])

    class Model(torch.nn.Module):
        def forward(self, x):
            return own_reads(x)

    return _outcome(r, Model(), torch.ones(8, 8, device=r.device))


def none_usable_body(r: Rank, tag: str) -> dict:
    """Every registered implementation fails while traced: the op's own is what is
    left, used without benchmarking, and right."""
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    group = _named_group(r, tag)

    none_usable = _unwaited_sum_op(f"none_usable_{tag}", group)

    def needs_a_capability(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("needs a capability this machine lacks")

    register_custom_op_autotuning(
        none_usable, configs=[CustomOpConfig(needs_a_capability)]
    )

    class Model(torch.nn.Module):
        def forward(self, x):
            return none_usable(x)

    torch.manual_seed(7 + r.rank)
    return _outcome(r, Model(), torch.randn(16, 16, device=r.device))


def untuned_body(r: Rank, tag: str, untuned: str) -> dict:
    """Upstream's pattern left untuned: collective autotuning "switched_off", the op
    called at a "data_dependent" (unbacked) size, or "both". The op's own
    implementation runs, and its output, never waited for in its body, is read at once
    by the model. The op names its group (an argument): at an unbacked size no choice
    can be traced to find its collectives (upstream fails the compile of any op tuned
    there)."""
    from torch._inductor import config
    from torch._inductor.kernel.custom_op import (
        CustomOpConfig,
        register_custom_op_autotuning,
    )

    group = _named_group(r, tag)

    @torch.library.custom_op(f"conformance::untuned_{tag}", mutates_args=())
    def unwaited(x: torch.Tensor, group_name: str) -> torch.Tensor:
        result = x.clone()
        return _c10d.all_reduce_(result, "sum", group_name)

    @unwaited.register_fake
    def _(x, group_name):
        return torch.empty_like(x)

    def waits(x: torch.Tensor, group_name: str) -> torch.Tensor:
        return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group_name))

    register_custom_op_autotuning(unwaited, configs=[CustomOpConfig(waits)])

    def model(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        if untuned != "switched_off":
            rows = n.item()
            torch._check_is_size(rows)
            torch._check(rows <= x.size(0))
            x = x[:rows]
        return unwaited(x, group) + 1

    torch.manual_seed(11 + r.rank)
    x = torch.randn(1024, 512, device=r.device)  # 2 MiB: a read races with the sum
    rows = x.size(0) - 24
    start = len(collective_autotune_records())
    with (
        config.patch(collective_autotune=untuned == "data_dependent"),
        torch._dynamo.config.patch(capture_scalar_outputs=True),
    ):
        y = torch.compile(model, fullgraph=True)(x, torch.tensor(rows))
    if untuned != "switched_off":
        x = x[:rows]
    records = collective_autotune_records()[start:]
    return {
        "shape_ok": y.shape == x.shape,
        "error": (y - 1 - _summed(r, x)).abs().max().item(),
        "records": [(rec.key, rec.decision, rec.winner, rec.reason) for rec in records],
    }


# -- the tests -------------------------------------------------------------------------------


def _tag(test: str, device: str, world_size: int) -> str:
    return f"{test}_{device}_{world_size}"


def _same_everywhere(test: TestCase, outcomes: list[dict]) -> dict:
    """Every rank's value is the all-reduce of every rank's input, and every rank made
    the same decisions; returns rank 0's outcome."""
    for rank, outcome in enumerate(outcomes):
        test.assertTrue(outcome["shape_ok"], f"rank {rank}")
        test.assertLess(outcome["error"], 1e-3, f"rank {rank}: {outcome}")
        test.assertEqual(
            outcome["records"], outcomes[0]["records"], f"rank {rank} disagrees"
        )
    return outcomes[0]


def check_cheapest_choice_wins(
    test: TestCase,
    body: Callable[..., dict],
    cheapest: str,
    world_size: int,
    device: str,
) -> dict:
    """``body`` on ``world_size`` ranks with choice ``cheapest`` given the lowest cost:
    every rank benchmarks and inlines it; rank 0's outcome."""
    outcome = _same_everywhere(
        test,
        assert_all_ok(
            run_ranks(
                world_size,
                body,
                _tag(body.__name__.removesuffix("_body"), device, world_size),
                device=device,
                timing=Costs({cheapest: 5.0}),
            )
        ),
    )
    ((_, decision, winner, _),) = outcome["records"]
    test.assertEqual(decision, "benchmark")
    test.assertEqual(winner, cheapest)
    return outcome


def check_in_place_choice_wins(test: TestCase, world_size: int, device: str) -> None:
    """:func:`in_place_body`: the in-place choice is timed beside the others and,
    given the lowest cost, wins on every rank."""
    outcome = check_cheapest_choice_wins(
        test, in_place_body, "dist_all_reduce", world_size, device
    )
    test.assertEqual(
        outcome["timed"][0],
        [("default", "ok"), ("dist_all_reduce", "ok"), ("functional", "ok")],
    )


class TestUpstreamPatterns(TestCase):
    """Upstream's test file's patterns, the value checked on every rank."""

    @parametrize("world_size", [2, 4])
    @parametrize("device", DEVICE_CASES)
    def test_equivalent_allreduce_strategies(
        self, device: str, world_size: int
    ) -> None:
        # Both unwaited strategies are now benchmarked, beside the op's own, and the
        # one given the lowest cost wins, waited for where its author left the wait out.
        outcome = check_cheapest_choice_wins(
            self, equivalent_strategies_body, "avg_allreduce_scaled", world_size, device
        )
        self.assertEqual(
            outcome["timed"][0],
            [
                ("avg_allreduce_scaled", "ok"),
                ("default", "ok"),
                ("sum_allreduce", "ok"),
            ],
        )

    @parametrize("device", DEVICE_CASES)
    def test_an_in_place_dist_all_reduce_is_timed_and_wins_where_fastest(
        self, device: str
    ) -> None:
        check_in_place_choice_wins(self, 2, device)

    @parametrize("world_size", [2, 4])
    @parametrize("device", DEVICE_CASES)
    def test_vllm_style_allreduce(self, device: str, world_size: int) -> None:
        tag = _tag("vllm", device, world_size)
        outcome = _same_everywhere(
            self,
            assert_all_ok(run_ranks(world_size, vllm_style_body, tag, device=device)),
        )
        ((_, decision, _, _),) = outcome["records"]
        self.assertEqual(decision, "benchmark")
        self.assertEqual(
            [name for name, status in outcome["timed"][0] if status == "ok"],
            ["default", "nccl_allreduce_direct", "vllm_buffer_copy_allreduce"],
        )

    @parametrize("device", DEVICE_CASES)
    def test_own_implementation_reading_before_wait_stops_every_rank(
        self, device: str
    ) -> None:
        tag = _tag("own_reads", device, 2)
        results = run_ranks(2, own_reads_before_wait_body, tag, device=device)
        for result in results:
            self.assertIsNotNone(result.error, f"rank {result.rank} compiled a racy op")
            self.assertIn("CollectiveAutotuneError", result.error)
            self.assertIn(
                "its own implementation reads the output of _c10d_functional::all_reduce_ "
                "before wait_tensor (in aten::mul.Tensor)",
                result.error,
            )

    @parametrize("device", DEVICE_CASES)
    def test_no_usable_choice_runs_the_ops_own_implementation(
        self, device: str
    ) -> None:
        tag = _tag("none_usable", device, 2)
        outcome = _same_everywhere(
            self, assert_all_ok(run_ranks(2, none_usable_body, tag, device=device))
        )
        ((_, decision, winner, reason),) = outcome["records"]
        self.assertEqual((decision, winner), ("use", "default"))
        self.assertIn("needs_a_capability", reason)  # the log says why

    @parametrize("untuned", ["switched_off", "data_dependent", "both"])
    @parametrize("device", DEVICE_CASES)
    def test_an_untuned_op_is_waited_for_where_its_body_does_not_wait(
        self, device: str, untuned: str
    ) -> None:
        # Its own implementation runs as an opaque call: Inductor waits after it.
        tag = _tag(f"untuned_{untuned}", device, 2)
        outcome = _same_everywhere(
            self,
            assert_all_ok(run_ranks(2, untuned_body, tag, untuned, device=device)),
        )
        self.assertTrue(
            all(winner == "default" for _, _, winner, _ in outcome["records"]),
            outcome["records"],
        )


instantiate_parametrized_tests(TestUpstreamPatterns)


if __name__ == "__main__":
    run_tests()
