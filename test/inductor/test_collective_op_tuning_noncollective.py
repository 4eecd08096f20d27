# Owner(s): ["module: inductor"]
"""Ops that do not communicate: the overlay leaves them as upstream has them.

Every scenario of ``noncollective_probe.py`` (a non-collective custom op registered with
``register_custom_op_autotuning``; no torch.distributed) is compiled twice by the running
interpreter, each time in a process of its own: once on upstream torch exactly (the
probe's ``--pristine`` serves every file the overlay patched from the pristine copy the
overlay kept of it) and once with the overlay. Where upstream succeeds, the overlay must
do exactly what upstream does: the same choices in each autotuning call, the same
choices benchmarked, the same winners and counters, the same generated code and the same
result. Where upstream fails, the overlay may only succeed, with the right result, by a
fix named in ``NAMED_FIXES`` below (the failure upstream raises, what the overlay does
about it), each of which ``docs/source/collective_autotuning.md`` lists so that it can
become a patch of its own. A named fix whose upstream does not fail is stale and fails
here too.

Runs on any supported minor (2.11, 2.13, 2.14, 2.15); skips where the overlay is not applied
to the running torch. About 80 seconds per minor on a 2-core CPU: the two processes run
side by side, each compiling every scenario in a fresh Dynamo and Inductor cache.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)


PROBE = Path(__file__).resolve().with_name("noncollective_probe.py")
STATE_DIR = ".collective_autotuning_overlay"  # tools/overlay.py's STATE_DIR
MARKER = "NONCOLLECTIVE_PROBE "
SCENARIOS = [
    "static",
    "pointwise_input",
    "raises_while_traced",
    "one_config",
    "dynamic",
    "dynamic_standard",
]
MINOR = ".".join(torch.__version__.split("+")[0].split(".")[:2])
MANIFEST = Path(torch.__file__).resolve().parent / STATE_DIR / "manifest.json"


@dataclasses.dataclass(frozen=True)
class NamedFix:
    """An upstream failure on an op that does not communicate, which the overlay fixes."""

    upstream_failure: str
    overlay_fix: str
    pristine_error: str  # the type of the exception at the root of upstream's failure
    # What the overlay's compile must show instead: a substring of the winner of every
    # autotuning call (None: no autotuning call at all), and a substring that no choice
    # may have (the choice the fix drops).
    winner: str | None
    dropped: str | None = None


_UNREALIZED = NamedFix(
    upstream_failure=(
        "an unrealized pointwise input (op(relu(x @ w))) has no strides: the choices' "
        "layout inference (SubgraphTemplate._infer_custom_op_layout) calls get_stride() "
        "on it, ir.Pointwise raises NotImplementedError('Pointwise'), the compile fails"
    ),
    overlay_fix=(
        "prepare_choices realizes the op's inputs before its choices are traced "
        "(kernel/collective/hooks.py)"
    ),
    pristine_error="NotImplementedError",
    winner="double_by_mul",
)
_RAISES = NamedFix(
    upstream_failure=(
        "an implementation that raises while traced (a capability check) raises out of "
        "the choices' layout inference (SubgraphTemplate._infer_custom_op_layout calls "
        "it on fake inputs): the compile fails"
    ),
    overlay_fix=(
        "guarded_implementation traces it as the op itself and marks it; "
        "detect_collective drops it with a warning, the other choices are tuned "
        "(kernel/collective/choices.py, kernel/collective/hooks.py)"
    ),
    pristine_error="NotImplementedError",
    winner="double_by_mul",
    dropped="double_needs_capability",
)
_RAISES_ALONE = NamedFix(
    upstream_failure=(
        "the only config's implementation raises while traced: the compile fails"
    ),
    overlay_fix=(
        "the choice is dropped as above; the op's own implementation is the only choice "
        "left, inlined untuned (no autotuning call)"
    ),
    pristine_error="NotImplementedError",
    winner=None,
    dropped="double_needs_capability",
)

# (minor, scenario): the fix. Where upstream works, nothing may be listed.
NAMED_FIXES: dict[tuple[str, str], NamedFix] = {
    ("2.11", "pointwise_input"): _UNREALIZED,
    ("2.11", "raises_while_traced"): _RAISES,
    ("2.11", "one_config"): _RAISES_ALONE,
    ("2.13", "raises_while_traced"): _RAISES,
    ("2.13", "one_config"): _RAISES_ALONE,
    ("2.14", "raises_while_traced"): _RAISES,
    ("2.14", "one_config"): _RAISES_ALONE,
    ("2.15", "raises_while_traced"): _RAISES,
    ("2.15", "one_config"): _RAISES_ALONE,
}


def _overlay_applied() -> str | None:
    """Why the overlay cannot be compared here (None: it can)."""
    if not MANIFEST.is_file():
        return f"the overlay is not applied to the running torch ({MANIFEST.parent.parent})"
    if not PROBE.is_file():
        return f"{PROBE} is missing"
    return None


@functools.lru_cache(None)
def probe_runs() -> dict[str, dict[str, Any]]:
    """Both modes, each in a process of its own, side by side: {mode: the probe's report}."""
    commands = {
        "pristine": [sys.executable, str(PROBE), ",".join(SCENARIOS), "--pristine"],
        "overlay": [sys.executable, str(PROBE), ",".join(SCENARIOS)],
    }
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TORCHINDUCTOR_", "TORCH_LOGS"))
    }
    env["PYTHONPATH"] = ""  # not this checkout's torch/ folder: the installed torch
    env["PYTHONHASHSEED"] = "0"  # symbols are ordered by hash in the generated code
    with tempfile.TemporaryDirectory() as cwd:
        running = {
            mode: subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for mode, command in commands.items()
        }
        reports = {}
        for mode, proc in running.items():
            try:
                stdout, stderr = proc.communicate(timeout=900)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            lines = [line for line in stdout.splitlines() if line.startswith(MARKER)]
            if proc.returncode != 0 or not lines:
                raise AssertionError(
                    f"the probe failed in {mode} mode (exit {proc.returncode}):\n"
                    f"{stdout[-3000:]}\n{stderr[-6000:]}"
                )
            reports[mode] = json.loads(lines[-1][len(MARKER) :])
    return reports


def observable(report: dict[str, Any]) -> dict[str, Any]:
    """What must be the same with the overlay as upstream (timings, which vary from run
    to run, and the seconds taken are not)."""
    return {
        "autotune_calls": [
            {k: call[k] for k in ("name", "choices", "timed", "failed", "winner")}
            for call in report["autotune_calls"]
        ],
        "benchmarked": report["benchmarked"],
        "counters": report["counters"],
        "result": report.get("result"),
        "code": report.get("code"),
    }


def describe_difference(pristine: dict[str, Any], overlay: dict[str, Any]) -> str:
    """Each field that differs; for the code, a unified diff."""
    parts = []
    for key in pristine:
        if pristine[key] == overlay[key]:
            continue
        if key == "code":
            a, b = pristine[key] or [], overlay[key] or []
            parts.append(f"code: {len(a)} modules upstream, {len(b)} with the overlay")
            for i in range(max(len(a), len(b))):
                left = a[i] if i < len(a) else ""
                right = b[i] if i < len(b) else ""
                if left != right:
                    parts.append(
                        "".join(
                            difflib.unified_diff(
                                left.splitlines(keepends=True),
                                right.splitlines(keepends=True),
                                f"upstream/code[{i}]",
                                f"overlay/code[{i}]",
                                n=2,
                            )
                        )
                    )
        else:
            parts.append(
                f"{key}:\n  upstream: {json.dumps(pristine[key])}\n  overlay:  {json.dumps(overlay[key])}"
            )
    return "\n".join(parts)


def _failure(report: dict[str, Any]) -> str:
    error = report.get("error") or {}
    return (
        f"{error.get('type')} (root: {error.get('root_type')}: {error.get('root_message')})\n"
        f"{report.get('traceback_tail', '')[-2000:]}"
    )


_SKIP = _overlay_applied()


class TestNonCollectiveOpsUntouched(TestCase):
    def setUp(self) -> None:
        super().setUp()
        if _SKIP:
            self.skipTest(_SKIP)

    def _reports(self, scenario: str) -> tuple[dict[str, Any], dict[str, Any]]:
        runs = probe_runs()
        return runs["pristine"]["scenarios"][scenario], runs["overlay"]["scenarios"][
            scenario
        ]

    @parametrize("scenario", SCENARIOS)
    def test_overlay_changes_nothing_or_a_named_fix(self, scenario: str) -> None:
        pristine, overlay = self._reports(scenario)
        fix = NAMED_FIXES.get((MINOR, scenario))
        if pristine["ok"]:
            self.assertTrue(
                pristine["result"]["matches_eager"],
                f"upstream's own result is wrong: {pristine}",
            )
            self.assertIsNone(
                fix,
                f"NAMED_FIXES lists ({MINOR!r}, {scenario!r}), but upstream torch {MINOR} "
                "compiles it: the entry is stale",
            )
            self.assertTrue(
                overlay["ok"],
                f"upstream torch {MINOR} compiles {scenario}; the overlay fails it: "
                + _failure(overlay),
            )
            a, b = observable(pristine), observable(overlay)
            self.assertTrue(
                a == b,
                f"the overlay changes {scenario} on torch {MINOR}, where upstream works:\n"
                + describe_difference(a, b),
            )
            return
        self.assertIsNotNone(
            fix,
            f"upstream torch {MINOR} fails {scenario}, and NAMED_FIXES names no fix for it: "
            + _failure(pristine),
        )
        self.assertEqual(
            pristine["error"]["root_type"],
            fix.pristine_error,
            f"upstream fails {scenario} otherwise than the named fix says: "
            + _failure(pristine),
        )
        self.assertTrue(
            overlay["ok"],
            f"the named fix of {scenario} does not work: " + _failure(overlay),
        )
        self.assertTrue(overlay["result"]["matches_eager"], overlay["result"])
        if fix.winner is None:
            self.assertEqual(
                overlay["autotune_calls"], [], "expected no autotuning call"
            )
        else:
            self.assertTrue(overlay["winners"], "expected an autotuning call")
            for winner in overlay["winners"]:
                self.assertIn(fix.winner, winner)
        if fix.dropped is not None:
            for call in overlay["autotune_calls"]:
                self.assertFalse([c for c in call["choices"] if fix.dropped in c], call)
            self.assertFalse([c for c in overlay["benchmarked"] if fix.dropped in c])

    def test_named_fixes_name_scenarios_that_exist(self) -> None:
        unknown = [key for key in NAMED_FIXES if key[1] not in SCENARIOS]
        self.assertEqual(unknown, [])
        self.assertTrue(
            all(minor in ("2.11", "2.13", "2.14", "2.15") for minor, _ in NAMED_FIXES),
            NAMED_FIXES,
        )

    def test_pristine_mode_runs_upstream_exactly(self) -> None:
        runs = probe_runs()
        manifest = json.loads(MANIFEST.read_text())
        served = {
            rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            for rel in manifest["files"]
        }
        pristine = runs["pristine"]
        self.assertEqual(pristine["torch"], torch.__version__)
        # Every patched module it imported was upstream's; none of the overlay's ran.
        self.assertEqual(
            set(pristine["pristine_served"]) | set(pristine["pristine_not_imported"]),
            served,
        )
        self.assertEqual(pristine["collective_modules"], [])
        # With the overlay, upstream's lowering.py imports every module of kernel/ (its
        # import_submodule(kernel)), so ours are loaded whether an op communicates or not.
        self.assertEqual(runs["overlay"]["mode"], "overlay")
        self.assertIsInstance(runs["overlay"]["collective_modules"], list)


instantiate_parametrized_tests(TestNonCollectiveOpsUntouched)


if __name__ == "__main__":
    run_tests()
