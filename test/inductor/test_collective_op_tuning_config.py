# Owner(s): ["module: inductor"]
"""Configuration: bad knobs fail at once, unparsable environment values and knobs that
differ between ranks name the variable, and switched off the patch uses no Store and
no thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch._inductor.runtime import collective_protocol
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import collective_ops as ops
from collective_harness import (
    single_process,
    assert_all_ok,
    compile_and_check,
    Rank,
    run_ranks,
)
from collective_scenarios import (
    COMPILE_MARGIN_S,
    patched_timeout,
    register_two_choices,
)


# -- bad configuration fails at once -----------------------------------------------------------------------


def bad_config_body(r: Rank, patch: dict, group: str) -> None:
    ops.register_all_reduce(
        ops.all_reduce_then("one_all_reduce"), ops.chunked_all_reduce
    )
    with torch._inductor.config.patch(patch):
        compile_and_check(
            lambda x: ops.all_reduce(x, group or r.group.group_name), torch.randn(8, 8)
        )


# -- settings that differ between ranks ------------------------------------------------------------


def differing_knob_body(r: Rank, knob: str, values: tuple) -> dict:
    register_two_choices()
    begin = time.monotonic()
    try:
        with patched_timeout(), torch._inductor.config.patch({knob: values[r.rank]}):
            compile_and_check(
                lambda x: ops.all_reduce(x, r.group.group_name),
                torch.randn(8, 8, device=r.device),
            )
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "s": time.monotonic() - begin}
    return {"error": None, "s": time.monotonic() - begin}


# -- the Store -----------------------------------------------------------------------------------------


def switched_off_body(r: Rank) -> dict:
    import threading

    register_two_choices()
    store = dist.distributed_c10d._get_default_store()
    # Barriers around both counts: no peer is still starting, or already leaving (the
    # harness's own "harness/done" key), while a rank counts.
    dist.barrier()
    keys = store.num_keys()
    records = compile_and_check(
        lambda x: ops.all_reduce(x, r.group.group_name),
        torch.randn(8, 8, device=r.device),
    )
    dist.barrier()
    new_keys = store.num_keys() - keys
    dist.barrier()
    return {
        "records": records,
        "new_keys": new_keys,
        "participant": collective_protocol._participant is not None,
        "threads": [t.name for t in threading.enumerate() if "collective" in t.name],
    }


class TestConfiguration(TestCase):
    @parametrize(
        "patch,group,message",
        [
            (
                {"collective_benchmark_timeout": 0},
                "",
                "collective_benchmark_timeout=0: seconds, > 0",
            ),
            (
                {"collective_benchmark_rounds": 0},
                "",
                "collective_benchmark_rounds=0: an int >= 1",
            ),
            (
                {"collective_benchmark_mode": "fast"},
                "",
                "collective_benchmark_mode='fast'",
            ),
            ({}, "no_such_group", "group_name='no_such_group' names no process group"),
        ],
    )
    def test_bad_configuration_fails_at_once(self, patch, group, message):
        (result,) = run_ranks(1, bad_config_body, patch, group)
        self.assertIsNotNone(result.error)
        self.assertIn(message, result.error)
        self.assertLess(result.wall_s, COMPILE_MARGIN_S)

    @single_process
    def test_unparsable_environment_value_names_the_variable(self):
        # Read at import, as upstream's numeric knobs are.
        env = {**os.environ, "TORCHINDUCTOR_COLLECTIVE_BENCHMARK_ROUNDS": "many"}
        imported = subprocess.run(
            [sys.executable, "-c", "import torch._inductor.config"],
            env=env,
            capture_output=True,
            text=True,
        )
        self.assertNotEqual(imported.returncode, 0)
        self.assertIn(
            "TORCHINDUCTOR_COLLECTIVE_BENCHMARK_ROUNDS='many' is not a valid int",
            imported.stderr,
        )

    @parametrize(
        "knob,values",
        [
            ("collective_benchmark_warmup", (5, 6)),
            ("collective_benchmark_sample_us", (1000.0, 5000.0)),
            ("collective_benchmark_rounds", (3, 20)),
            # Group-wide too: ranks that differ would compile different graphs.
            ("collective_autotune_range_graphs", (True, False)),
            ("collective_autotune_compile_range", (None, (1, 64))),
        ],
    )
    def test_settings_that_differ_between_ranks_fail_every_rank_naming_the_variable(
        self, knob, values
    ):
        results = assert_all_ok(run_ranks(2, differing_knob_body, knob, values))
        for result in results:
            self.assertIsNotNone(result["error"], msg=result)
            self.assertIn("CollectiveAutotuneError", result["error"], msg=result)
            # An engine sets collective_autotune_compile_range per compile: no variable.
            named = (
                f"torch._inductor.config.{knob} (set in the config of a compile)"
                if knob == "collective_autotune_compile_range"
                else f"TORCHINDUCTOR_{knob.upper()} (torch._inductor.config.{knob})"
            )
            self.assertIn(named, result["error"], msg=result["error"])
            self.assertIn(
                f"{values[0]!r} on group ranks [0]",
                result["error"],
                msg=result["error"],
            )
            self.assertLess(result["s"], COMPILE_MARGIN_S)

    def test_switched_off_the_patch_uses_no_store_and_no_thread(self):
        off = {"TORCHINDUCTOR_COLLECTIVE_AUTOTUNE": "0"}
        a, b = assert_all_ok(
            run_ranks(2, switched_off_body, env=off, fresh_processes=True)
        )
        for result in (a, b):
            (record,) = result["records"]
            self.assertEqual(record.winner, "default")
            self.assertEqual(record.session, "")
            self.assertEqual(result["new_keys"], 0, msg=str(result))
            self.assertFalse(result["participant"], msg=result)
            self.assertEqual(result["threads"], [], msg=str(result))


instantiate_parametrized_tests(TestConfiguration)


if __name__ == "__main__":
    run_tests()
