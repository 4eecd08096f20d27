"""Collective autotuning inside vLLM 0.33: a compile range per winner, the recipe's code.

vLLM's ``PiecewiseBackend`` compiles every piece of the model up front, for each compile
range and each compile size (``CompilationConfig.compile_ranges_endpoints`` and
``compile_sizes``). A range compiled as it is compiles the in-graph dispatch: each size
runs its ladder range's winner, at the cost of a comparison per winner change. Two steps
make each range inline one winner, with no dispatch:

1. Its endpoints where the winners change: ``compile_ranges_endpoints=split_points()``.
   vLLM keeps the points p with 1 < p < max_num_batched_tokens and compiles the
   inclusive ranges [1, p0], [p0 + 1, p1], ..., [p_last + 1, max_num_batched_tokens].
2. Each range handed to Inductor: vLLM gives every range the same
   ``inductor_compile_config``; its only per-range code is
   ``vllm.compilation.compiler_interface.set_inductor_config(config, compile_range)``.
   The smallest addition is :func:`set_inductor_config_with_range` in its place::

       import vllm.compilation.compiler_interface as compiler_interface

       compiler_interface.set_inductor_config = set_inductor_config_with_range

vLLM's cache key does not see this addition (it hashes the global Inductor config, not
what set_inductor_config adds per range): a cache compiled without it is loaded as it
is; clear it (or change the config) once. Without the addition each range compiles the
in-graph dispatch: every size still runs its ladder range's winner.

test/inductor/test_collective_op_tuning_vllm.py runs this code in vLLM 0.33.0's own
pipeline (make test-vllm).
"""

from __future__ import annotations

from typing import Any

from vllm.compilation.compiler_interface import (
    set_inductor_config as vllm_set_inductor_config,
)


def split_points() -> list[int]:
    """The sizes after which the tuned ops' winners change, for
    ``compile_ranges_endpoints``: those kept with the decisions of earlier jobs
    (readable before the first compile; a first job finds none and compiles one
    range), or of this process's compiles."""
    from torch._inductor.kernel.collective.api import winner_change_points

    return winner_change_points()


def set_inductor_config_with_range(config: dict[str, Any], compile_range: Any) -> None:
    """vLLM's per-range Inductor config, and the range itself (inclusive), so that a
    tuned op inlines the one winner of the range."""
    vllm_set_inductor_config(config, compile_range)
    config["collective_autotune_compile_range"] = (
        compile_range.start,
        compile_range.end,
    )
