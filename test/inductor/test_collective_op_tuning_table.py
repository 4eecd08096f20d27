# Owner(s): ["module: inductor"]
"""The hand-set threshold table that benchmarks/serving_step.py races the tuner against.

``tp_demo::table_all_reduce`` (examples/tp_allreduce/ops.py) picks its implementation by
message size from vLLM's limits, as a serving engine does. Checked here: the pick per
world size, compute capability and size, on both sides of every limit, against the
implementations vLLM documents; and on real process groups, that the op sums as a plain
all-reduce does on both sides of each limit, running the implementation it picked.
"""

from __future__ import annotations

import unittest
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from collective_harness import (
    assert_all_ok,
    DEVICE_CASES,
    Rank,
    run_ranks,
    single_process,
)
from examples.tp_allreduce import ops as tp_ops


KiB, MiB = 1 << 10, 1 << 20
ONE, TWO, NCCL = "symm_mem_one_shot", "symm_mem_two_shot", "default"

# Per (world size, compute capability): (bytes, implementation), written out from vLLM's
# tables and kernels rather than derived from the op's code: its custom all-reduce (one
# stage on 2 ranks, else below 512 KiB on 4 and 256 KiB on 6 or 8; two stages above) below
# min(CUSTOM_ALL_REDUCE_MAX_SIZES, 8 MiB), symmetric memory up to
# SYMM_MEM_ALL_REDUCE_MAX_SIZES, NCCL above.
DOCUMENTED: dict[tuple[int, str | None], list[tuple[int, str]]] = {
    # Hopper, 2 ranks: custom all-reduce below 8 MiB (its buffer), symmetric memory to 64 MiB.
    (2, "9.0"): [
        (1, ONE),
        (8 * MiB - 1, ONE),
        (8 * MiB, TWO),
        (64 * MiB, TWO),
        (64 * MiB + 1, NCCL),
    ],
    # 4 ranks: one stage below 512 KiB, two below 8 MiB, symmetric memory to 32 MiB.
    (4, "9.0"): [
        (512 * KiB - 1, ONE),
        (512 * KiB, TWO),
        (8 * MiB, TWO),
        (32 * MiB, TWO),
        (32 * MiB + 1, NCCL),
    ],
    # 6 ranks: one stage below 256 KiB, custom all-reduce below 512 KiB, then to 64 MiB.
    (6, "9.0"): [
        (256 * KiB - 1, ONE),
        (256 * KiB, TWO),
        (512 * KiB, TWO),
        (64 * MiB, TWO),
        (64 * MiB + 1, NCCL),
    ],
    # 8 ranks: custom all-reduce below 256 KiB (one stage), symmetric memory to 64 MiB.
    (8, "9.0"): [
        (256 * KiB - 1, ONE),
        (256 * KiB, TWO),
        (64 * MiB, TWO),
        (64 * MiB + 1, NCCL),
    ],
    # Blackwell, 2 ranks: custom all-reduce below 2 MiB, symmetric memory to 8 MiB.
    (2, "10.0"): [
        (2 * MiB - 1, ONE),
        (2 * MiB, TWO),
        (8 * MiB, TWO),
        (8 * MiB + 1, NCCL),
    ],
    # A capability the table does not list: the custom all-reduce alone, then NCCL.
    (2, "8.0"): [(8 * MiB - 1, ONE), (8 * MiB, NCCL)],
    # World sizes and devices it does not list: NCCL at every size.
    (1, "9.0"): [(1, NCCL), (64 * MiB, NCCL)],
    (3, "9.0"): [(1, NCCL)],
    (16, "9.0"): [(1, NCCL)],
    (2, None): [(1, NCCL), (64 * MiB, NCCL)],
}


def sizes_around(limits: tp_ops.TableLimits, element_size: int) -> list[int]:
    """Message sizes in bytes, whole elements, on both sides of each of ``limits``."""
    below = {limits.one_shot_below, limits.two_shot_below} - {0}
    sizes = {n for limit in below for n in (limit - element_size, limit)}
    if limits.symm_mem_up_to:
        sizes |= {limits.symm_mem_up_to, limits.symm_mem_up_to + element_size}
    return sorted(sizes)


def table_body(r: Rank) -> list[tuple[int, list[str]]]:
    """Each size's implementations that ran, after checking the op's sum at that size."""
    capability = tp_ops.device_capability(r.device)
    # On CPU the table lists no device: the sizes are those of 2 Hopper GPUs.
    limits = tp_ops.table_limits(r.world_size, capability or "9.0")
    ran: list[str] = []

    def recorded(name: str):
        implementation = tp_ops.TABLE_IMPLEMENTATIONS[name]

        def call(x: torch.Tensor, group_name: str) -> torch.Tensor:
            ran.append(name)
            return implementation(x, group_name)

        return call

    found = []
    gen = torch.Generator().manual_seed(r.rank)  # ranks differ: a wrong sum shows
    recorders = {name: recorded(name) for name in tp_ops.TABLE_IMPLEMENTATIONS}
    with mock.patch.dict(tp_ops.TABLE_IMPLEMENTATIONS, recorders):
        for nbytes in sizes_around(limits, torch.float32.itemsize):
            x = torch.randn(nbytes // torch.float32.itemsize, generator=gen).to(
                r.device
            )
            expected = x.clone()
            dist.all_reduce(expected, group=r.group)
            ran.clear()
            torch.testing.assert_close(
                tp_ops.table_all_reduce(x, r.group.group_name), expected
            )
            found.append((nbytes, list(ran)))
    return found


class TestTableOp(TestCase):
    @parametrize(
        "world_size, capability, nbytes, implementation",
        [(*where, *pick) for where, picks in DOCUMENTED.items() for pick in picks],
    )
    @single_process
    def test_table_picks_what_vllm_runs(
        self, world_size, capability, nbytes, implementation
    ):
        self.assertEqual(
            tp_ops.table_limits(world_size, capability).pick(nbytes), implementation
        )

    @parametrize("device", DEVICE_CASES)
    def test_table_op_sums_as_all_reduce_on_both_sides_of_each_limit(self, device):
        per_rank = assert_all_ok(run_ranks(2, table_body, device=device))
        self.assertEqual(per_rank[1], per_rank[0])
        sizes = [nbytes for nbytes, _ in per_rank[0]]
        if device == "cpu":
            # Both sides of 2 Hopper GPUs' limits, each summed by the op's own (gloo) all-reduce.
            self.assertEqual(sizes, [8 * MiB - 4, 8 * MiB, 64 * MiB, 64 * MiB + 4])
            self.assertEqual([ran for _, ran in per_rank[0]], [[NCCL]] * 4)
        else:
            limits = tp_ops.table_limits(
                2, tp_ops.device_capability(torch.device("cuda"))
            )
            picks = [ran for _, ran in per_rank[0]]
            self.assertEqual(picks, [[limits.pick(n)] for n in sizes])
            # On 2 ranks each limit is a switch: the sizes come in pairs across one.
            self.assertTrue(
                all(below != above for below, above in zip(picks[::2], picks[1::2])),
                msg=picks,
            )


def symm_buffers_under_cudagraphs_body(r: Rank) -> list[int]:
    """The symmetric-memory ops written into a model compiled with CUDA graphs, whose
    buffer is made, then outgrown, in the graphs' warm-ups; after each, another model's
    warm-up checks the graphs' pool (Inductor's ``slow_path_cudagraph_asserts``, on by
    default). The sum at each size, and the buffers' sizes."""
    group_name = r.group.group_name

    def symmetric(x: torch.Tensor) -> torch.Tensor:
        x = tp_ops.symm_mem_one_shot(x * 2, group_name)
        return tp_ops.symm_mem_two_shot(x, group_name) + 1

    def other(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * 3) + 1

    compiled = torch.compile(symmetric, mode="reduce-overhead", dynamic=False)
    others = torch.compile(other, mode="reduce-overhead", dynamic=False)
    for rows in (4, 64):
        x = torch.full((rows, 256), 1.0 + r.rank, device=r.device)
        for _ in range(3):  # warm-up, record, replay
            out = compiled(x).clone()
            others(x)
        total = sum(1.0 + rank for rank in range(r.world_size))
        torch.testing.assert_close(
            out, torch.full_like(x, 2 * total * r.world_size + 1)
        )
    return [
        b.numel() for b in tp_ops._symm_buffers[(torch.float32, r.device, group_name)]
    ]


class TestSymmetricBuffers(TestCase):
    @parametrize("world_size", [1, 2])
    @unittest.skipIf(not torch.cuda.is_available(), "needs CUDA")
    def test_a_buffer_made_in_a_cudagraph_warm_up_stays_out_of_the_graphs_pool(
        self, world_size
    ):
        per_rank = assert_all_ok(
            run_ranks(world_size, symm_buffers_under_cudagraphs_body, device="cuda")
        )
        # Made at the first size, grown (doubled at least) at the second.
        self.assertTrue(
            all(sizes == [4 * 256, 64 * 256] for sizes in per_rank), msg=per_rank
        )


instantiate_parametrized_tests(TestTableOp)
instantiate_parametrized_tests(TestSymmetricBuffers)


if __name__ == "__main__":
    run_tests()
