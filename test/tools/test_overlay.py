# Owner(s): ["module: inductor"]
"""tools/overlay.py on fake torch installs: the patch series applied, checked, removed,
shared between minors, edited and refreshed.

Imports only the standard library and torch (its version, its location and its
TestCase): the Inductor tests import the overlay's own modules, which need it applied.
The commands run as a subprocess on a fake install in the test's own folder (a site
folder holding the upstream files the series edits and a version.py); the cases that
write patches call the tool's functions on a copy of patches/.

A minor's pristine files are at hand for the installed torch and for any venv of this
checkout (.venv*): the pristine copies the overlay keeps beside an overlaid install, or
the install's own files where the overlay is not applied; for 2.11 also under
../shared/upstream/ where that holds every file the series edits. Cases that need a
minor not at hand skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    subtest,
    TestCase,
)


REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "overlay.py"
STATE = ".collective_autotuning_overlay"


def _load_tool():
    spec = importlib.util.spec_from_file_location("overlay_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


overlay_tool = _load_tool()
SUPPORTED: tuple[str, ...] = overlay_tool.SUPPORTED


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def _key(minor: str) -> tuple[int, ...]:
    return tuple(int(p) for p in minor.split("."))


def _series(minor: str) -> list:
    return overlay_tool.read_series(minor)


def _newest_minor() -> str:
    """The series an unsupported torch gets: the newest supported one here."""
    return overlay_tool.newest_minor()


def _version_of(torch_dir: Path) -> str:
    text = (torch_dir / "version.py").read_text()
    return re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.MULTILINE).group(1)


def _pristine_at_hand() -> dict[str, tuple[str, Path]]:
    """Each minor whose pristine files are at hand: its version, their site folder."""
    found: dict[str, tuple[str, Path]] = {}
    installed = Path(torch.__file__).parent
    candidates = [installed]
    candidates += sorted(REPO.glob(".venv*/lib/python*/site-packages/torch"))
    for torch_dir in candidates:
        version = _version_of(torch_dir)
        state = torch_dir / STATE / "pristine"
        # Without the overlay's state the install is untouched: its files are
        # pristine (make test runs the 2.13 lane before 2.11's venv is overlaid).
        found.setdefault(
            _minor(version), (version, state if state.is_dir() else torch_dir.parent)
        )
    # 2.11's files kept beside the repository, where no venv has 2.11: only Inductor's
    # and a few more, so only where they hold every file 2.11's series edits.
    shared = REPO.parent / "shared" / "upstream" / "torch-2.11.0"
    if "2.11" not in found and all(
        (shared / rel).is_file() for rel in overlay_tool._paths(_series("2.11"))
    ):
        found["2.11"] = ("2.11.0", shared)
    return found


PRISTINE = _pristine_at_hand()


def _minors_param() -> list:
    params = []
    for minor in SUPPORTED:
        if minor in PRISTINE:
            params.append(minor)
        else:
            skip = unittest.skip(f"no pristine torch {minor} files at hand")
            params.append(subtest(minor, decorators=[skip]))
    return params


def _at_hand() -> str:
    """The installed torch's minor if its pristine files are at hand, else any."""
    installed = _minor(torch.__version__)
    if installed in PRISTINE:
        return installed
    if not PRISTINE:
        raise unittest.SkipTest("no supported torch's pristine files at hand")
    return next(iter(PRISTINE))


def _write_version(torch_dir: Path, version: str) -> None:
    (torch_dir / "version.py").write_text(f"__version__ = '{version}'\n")


def _fake_install(site: Path, minor: str, version: str | None = None) -> Path:
    """A torch package directory holding only the upstream files MINOR's series edits,
    as MINOR has them."""
    pristine_version, pristine = PRISTINE[minor]
    for rel in overlay_tool._paths(_series(minor)):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pristine / rel, site / rel)
    _write_version(site / "torch", version or pristine_version)
    return site / "torch"


def _overlay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True
    )


def _exact(path: Path) -> str:
    """PATH's bytes, one character each (latin-1 loses none): TestCase.assertEqual
    compares a str at once, where it compares bytes one by one (minutes for the
    upstream files)."""
    return path.read_bytes().decode("latin-1")


def _tree(root: Path) -> dict[str, str | tuple[str, str] | None]:
    """Everything under ROOT: a file's bytes (as _exact gives them), ("link", its
    target) for a link, None for a folder."""
    tree: dict[str, str | tuple[str, str] | None] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            tree[rel] = ("link", os.readlink(path))
        else:
            tree[rel] = None if path.is_dir() else _exact(path)
    return tree


def _last_hunk(minor: str):
    """The series' last patch, its last file, that file's hunk count and last hunk."""
    patch = _series(minor)[-1]
    fp = patch.files[-1]
    return patch, fp.path, len(fp.hunks), fp.hunks[-1]


class OverlayTestCase(TestCase):
    """A test with an empty folder of its own, ``self.tmp_path`` (removed after it)."""

    def setUp(self) -> None:
        super().setUp()
        tmp = tempfile.TemporaryDirectory(
            prefix="test_overlay_", ignore_cleanup_errors=True
        )
        self.addCleanup(tmp.cleanup)
        self.tmp_path = Path(tmp.name).resolve()

    def patch_tool(self, **attributes: object) -> None:
        """Set the tool's module ATTRIBUTES until the test ends."""
        patcher = mock.patch.multiple(overlay_tool, **attributes)
        patcher.start()
        self.addCleanup(patcher.stop)

    def patches_copy(self) -> Path:
        """The tool's functions working on a copy of patches/ (for cases that write
        it)."""
        copy = self.tmp_path / "patches"
        shutil.copytree(REPO / "patches", copy)
        self.patch_tool(PATCHES=copy, SERIES=copy / "series")
        return copy


class TestSeriesAsStored(OverlayTestCase):
    """The series as stored: its patches, their messages and parts."""

    def test_every_series_lists_its_patches_in_order_each_with_a_message(self):
        for minor in SUPPORTED:
            names = overlay_tool.series_names(minor)
            self.assertTrue(names, msg=minor)
            self.assertEqual(
                [n[:4] for n in names], sorted(n[:4] for n in names), msg=minor
            )
            for patch in _series(minor):
                # A patch that changes nothing is no patch.
                self.assertTrue(patch.files, msg=patch.name)
                self.assertTrue(
                    patch.head.startswith("Subject: [PATCH] "), msg=patch.name
                )
                # A part with a short header gives the message of the part it names.
                subject, _, body = patch.message.partition("\n\n")
                self.assertTrue(subject.startswith("Subject: [PATCH] "), msg=patch.name)
                self.assertIn("Why:", body, msg=patch.name)
                self.assertIn("Behaviour:", body, msg=patch.name)
                trailer = re.search(r"^Torch-Minors: (.+)$", patch.head, re.MULTILINE)
                self.assertTrue(trailer, msg=patch.name)
                self.assertIn(minor, trailer.group(1).split(), msg=patch.name)

    def test_minors_share_patch_text_and_no_hunk_is_stored_twice(self):
        files = sorted(p.name for p in overlay_tool.SERIES.glob("*.patch"))
        listed = {m: set(overlay_tool.series_names(m)) for m in SUPPORTED}
        # No stray patch files.
        self.assertEqual(set(files), set().union(*listed.values()))
        seen: dict[tuple, str] = {}
        for name in files:
            patch = overlay_tool.read_patch(name)
            minors = (
                re.search(r"^Torch-Minors: (.+)$", patch.text, re.MULTILINE)
                .group(1)
                .split()
            )
            self.assertEqual(
                {m for m in SUPPORTED if name in listed[m]}, set(minors), msg=name
            )
            users = {m for m in SUPPORTED if any(n[:4] == name[:4] for n in listed[m])}
            if ".torch-" in name:  # a per-minor part: the minors its name says, only
                self.assertEqual(
                    name.split(".torch-")[1][: -len(".patch")].split("+"), minors
                )
                self.assertLess(set(minors), users, msg=name)
            else:  # the shared part: every minor that has this patch
                self.assertEqual(set(minors), users, msg=name)
            for fp in patch.files:
                for hunk in fp.hunks:
                    key = overlay_tool._hunk_key(fp.path, hunk)
                    self.assertNotIn(
                        key, seen, msg=f"{name} repeats a hunk of {seen.get(key)}"
                    )
                    seen[key] = name
        # 2.13 and 2.14 are near-identical upstream: most of their hunks are shared.
        both = [n for n in files if n in listed["2.13"] and n in listed["2.14"]]
        shared = sum(overlay_tool.read_patch(n).n_hunks for n in both)
        self.assertGreaterEqual(shared, 0.8 * sum(p.n_hunks for p in _series("2.14")))

    def test_only_the_2_11_series_has_the_backport(self):
        backport = [n for n in overlay_tool.series_names("2.11") if "backport" in n]
        self.assertTrue(backport)
        self.assertIn(
            "torch/fx/experimental/symbolic_shapes.py",
            {fp.path for n in backport for fp in overlay_tool.read_patch(n).files},
        )
        for minor in (m for m in SUPPORTED if m != "2.11"):
            self.assertFalse(
                [n for n in overlay_tool.series_names(minor) if "backport" in n]
            )

    def test_no_hunk_only_reindents_upstream_lines(self):
        """An upstream line a hunk removes and adds back differs in more than
        indentation, unless the hunk removes the block around it (an `if`/`else:`
        gone)."""
        for name in sorted(p.name for p in overlay_tool.SERIES.glob("*.patch")):
            for fp in overlay_tool.read_patch(name).files:
                for hunk in fp.hunks:
                    body = hunk.text.splitlines()[1:]
                    removed = [ln[1:].strip() for ln in body if ln.startswith("-")]
                    added = [ln[1:].strip() for ln in body if ln.startswith("+")]
                    both = set(removed) & set(added) - {"", ")", "):", "]", "}"}
                    opener_gone = any(
                        r.endswith(":") and r not in added for r in removed
                    )
                    self.assertTrue(
                        opener_gone or not both,
                        msg=f"{name}: {fp.path}: re-indented {sorted(both)}",
                    )


class TestApplyAndRemove(OverlayTestCase):
    """Applying the series to a fake install and removing it again."""

    @parametrize("minor", _minors_param())
    def test_series_round_trip_restores_pristine_files(self, minor):
        torch_dir = _fake_install(self.tmp_path / "site", minor)
        before = _tree(self.tmp_path)
        series = _series(minor)

        applied = _overlay("--torch-dir", str(torch_dir), "apply")
        self.assertEqual(applied.returncode, 0, msg=applied.stderr)
        self.assertIn(
            f"patches/torch-{minor}.series ({len(series)} patches)", applied.stdout
        )
        self.assertFalse(applied.stderr)
        manifest = json.loads((torch_dir / STATE / "manifest.json").read_text())
        self.assertEqual(manifest["series"], minor)
        self.assertEqual(list(manifest["patches"]), [p.name for p in series])
        self.assertEqual(sorted(manifest["files"]), overlay_tool._paths(series))
        # What landed is each patch applied in turn to what the ones before it left.
        expected = {
            rel: (PRISTINE[minor][1] / rel).read_text() for rel in manifest["files"]
        }
        for patch in series:
            for fp in patch.files:
                expected[fp.path] = overlay_tool.patch_text(expected[fp.path], fp)
        for rel in manifest["files"]:
            patched = (torch_dir.parent / rel).read_text()
            self.assertEqual(patched, expected[rel])
            self.assertNotEqual(before[f"site/{rel}"], _exact(torch_dir.parent / rel))
        for rel in manifest["links"]:
            self.assertEqual((torch_dir.parent / rel).resolve(), REPO / rel)

        again = _overlay("--torch-dir", str(torch_dir), "apply")
        self.assertIn("already applied", again.stdout)
        status = _overlay("--torch-dir", str(torch_dir), "status").stdout
        self.assertIn(f"patches/torch-{minor}.series", status)
        for patch in series:
            self.assertIn(f"  applied patches/series/{patch.name}\n", status)
        self.assertNotIn("DRIFT", status)
        self.assertNotIn("STALE", status)
        self.assertNotIn("FORCED", status)
        # On an applied torch, `check` reads the pristine copies: every hunk applies.
        checked = _overlay("--torch-dir", str(torch_dir), "check")
        self.assertEqual(checked.returncode, 0, msg=checked.stdout)
        self.assertIn("checking the pristine copies", checked.stdout)
        n_hunks = sum(p.n_hunks for p in series)
        self.assertIn(
            f"hunks: {n_hunks} of {n_hunks} apply ({len(series)} patches)",
            checked.stdout,
        )
        for patch in series:
            self.assertIn(f"\n{patch.label}\n", checked.stdout)

        removed = _overlay("--torch-dir", str(torch_dir), "remove")
        self.assertEqual(removed.returncode, 0, msg=removed.stderr)
        self.assertIn(f"removed patches/torch-{minor}.series", removed.stdout)
        self.assertEqual(_tree(self.tmp_path), before)

    def test_a_minor_needs_its_own_parts(self):
        """Another minor's series does not apply: its per-minor parts name
        themselves."""
        minor = _at_hand()
        other = next(m for m in SUPPORTED if m != minor)
        mine = set(overlay_tool.series_names(minor))
        foreign = [p for p in _series(other) if p.name not in mine]
        self.assertTrue(foreign)  # the minors' upstream texts differ somewhere
        texts = {
            rel: (PRISTINE[minor][1] / rel).read_text()
            for rel in overlay_tool._paths(_series(minor))
        }
        _, problems = overlay_tool.apply_series(texts, _series(other))
        self.assertTrue(problems)
        failing = {line.split(":")[0] for line in problems if "not tried" not in line}
        self.assertLessEqual(failing, {p.label for p in foreign}, msg=problems)

    def test_status_names_a_patch_changed_since_it_was_applied(self):
        patches_copy = self.patches_copy()
        minor = _at_hand()
        install = overlay_tool.locate(
            None, str(_fake_install(self.tmp_path / "site", minor))
        )
        overlay_tool.apply(install)
        self.assertNotIn("STALE", overlay_tool.status(install))
        patch = _series(minor)[1]
        path = patches_copy / "series" / patch.name
        # Every part has a Subject line (only one of a patch's parts has its "Why:").
        path.write_text(path.read_text().replace("[PATCH] ", "[PATCH] reworded: ", 1))
        status = overlay_tool.status(install)
        self.assertIn(
            f"STALE   {patch.name} changed since it was applied; run apply again",
            status,
        )
        # Applied again, not "already applied".
        self.assertTrue(overlay_tool.apply(install).startswith("applied"))
        self.assertNotIn("STALE", overlay_tool.status(install))

    def test_apply_from_another_checkout_links_its_files(self):
        # Two checkouts applied in turn to one python (an A/B of two commits): the
        # second's apply links its own files; "already applied" kept the first's, and
        # the A/B ran one commit twice.
        minor = _at_hand()
        install = overlay_tool.locate(
            None, str(_fake_install(self.tmp_path / "site", minor))
        )
        overlay_tool.apply(install)
        other = self.tmp_path / "other"
        shutil.copytree(
            REPO / "torch",
            other / "torch",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        self.patch_tool(REPO=other)
        self.assertTrue(overlay_tool.apply(install).startswith("applied"))
        links = overlay_tool.our_files()
        self.assertTrue(links)
        self.assertTrue(
            all((install.site / rel).resolve() == other / rel for rel in links)
        )
        self.assertTrue(overlay_tool.apply(install).startswith("already applied"))


class TestHunkMatching(OverlayTestCase):
    """Where a hunk applies, and the hunks refused: not found, ambiguous, malformed."""

    def test_hunk_found_at_an_offset_applies_and_removes_byte_exactly(self):
        minor = _at_hand()
        first = _series(minor)[0]
        rel, hunk = first.files[0].path, first.files[0].hunks[0]
        plain = _fake_install(self.tmp_path / "plain" / "site", minor)
        self.assertEqual(_overlay("--torch-dir", str(plain), "apply").returncode, 0)
        patched_in_place = (plain.parent / rel).read_text()

        torch_dir = _fake_install(self.tmp_path / "moved" / "site", minor)
        moved = torch_dir.parent / rel
        added = "".join(
            f"# a line upstream added above the hunks {n}\n" for n in range(5)
        )
        moved.write_text(added + moved.read_text())
        before = _tree(self.tmp_path / "moved")

        checked = _overlay("--torch-dir", str(torch_dir), "check")
        self.assertEqual(checked.returncode, 0, msg=checked.stdout)
        # A shared patch gives the newest minor's line numbers: the hunk is where it is.
        pristine_lines = (
            (PRISTINE[minor][1] / rel).read_text().splitlines(keepends=True)
        )
        (line,) = overlay_tool._occurrences(pristine_lines, hunk.old)
        start, offset = hunk.old_start, line + 5 - hunk.old_start
        expected = (
            f"hunk 1: applies at line {line + 5} ({offset:+d} from the patch's {start})"
        )
        self.assertIn(f"{first.label}\n  {rel}\n    {expected}", checked.stdout)
        self.assertEqual(_tree(self.tmp_path / "moved"), before)

        applied = _overlay("--torch-dir", str(torch_dir), "apply")
        self.assertEqual(applied.returncode, 0, msg=applied.stderr)
        self.assertEqual(moved.read_text(), added + patched_in_place)
        self.assertEqual(
            _overlay("--torch-dir", str(torch_dir), "remove").returncode, 0
        )
        self.assertEqual(_tree(self.tmp_path / "moved"), before)

    def test_a_patch_that_does_not_apply_names_itself_and_nothing_changes(self):
        minor = _at_hand()
        patch, rel, number, hunk = _last_hunk(minor)
        torch_dir = _fake_install(self.tmp_path / "site", minor)
        # The last patch's last hunk: a refusal there shows no earlier file was written.
        path = torch_dir.parent / rel
        old = hunk.old
        block = "".join(old)
        changed = old[: len(old) // 2] + ["# upstream changed this line\n"]
        changed += old[len(old) // 2 + 1 :]
        self.assertEqual(path.read_text().count(block), 1)
        path.write_text(path.read_text().replace(block, "".join(changed)))
        before = _tree(self.tmp_path)

        refused = _overlay("--torch-dir", str(torch_dir), "apply")
        self.assertEqual(refused.returncode, 2)
        where = f"hunk {number} (the patch's line {hunk.old_start}) not found"
        self.assertIn(f"{patch.label}: {rel}: {where}", refused.stderr)
        self.assertIn("nothing changed", refused.stderr)
        self.assertEqual(_tree(self.tmp_path), before)

        checked = _overlay("--torch-dir", str(torch_dir), "check")
        self.assertEqual(checked.returncode, 2)
        report = checked.stdout.split(f"{patch.label}\n", 1)[1]
        self.assertIn(
            f"hunk {number}: NOT FOUND (the patch's line {hunk.old_start})", report
        )
        self.assertTrue(checked.stdout.rstrip().endswith("check: FAILED"))
        self.assertEqual(_tree(self.tmp_path), before)

    def test_later_patches_are_not_tried_on_a_file_an_earlier_one_failed_on(self):
        minor = _at_hand()
        series = _series(minor)
        # A file that two patches edit; break the first patch's first hunk there.
        rel = next(
            fp.path
            for fp in series[0].files
            if any(fp.path in {f.path for f in p.files} for p in series[1:])
        )
        first = next(fp for fp in series[0].files if fp.path == rel)
        later = next(p for p in series[1:] if rel in {f.path for f in p.files})
        torch_dir = _fake_install(self.tmp_path / "site", minor)
        path = torch_dir.parent / rel
        block = "".join(first.hunks[0].old)
        path.write_text(
            path.read_text().replace(block, "".join(first.hunks[0].old[1:]))
        )

        refused = _overlay("--torch-dir", str(torch_dir), "apply")
        self.assertEqual(refused.returncode, 2)
        self.assertIn(f"{series[0].label}: {rel}: hunk 1 ", refused.stderr)
        not_tried = f"{later.label}: {rel}: not tried, {series[0].label} failed on it"
        self.assertIn(not_tried, refused.stderr)

    def test_ambiguous_hunk_is_refused_listing_its_candidate_lines(self):
        minor = _at_hand()
        patch, rel, number, hunk = _last_hunk(minor)
        torch_dir = _fake_install(self.tmp_path / "site", minor)
        path = torch_dir.parent / rel
        path.write_text("".join(hunk.old) + path.read_text())  # the old lines twice
        before = _tree(self.tmp_path)
        start = path.read_text().splitlines(keepends=True)[len(hunk.old) :]
        second = overlay_tool._occurrences(start, hunk.old)[0] + len(hunk.old)
        lines = f"1, {second}"

        refused = _overlay("--torch-dir", str(torch_dir), "apply")
        self.assertEqual(refused.returncode, 2)
        expected = (
            f"{patch.label}: {rel}: hunk {number} (the patch's line {hunk.old_start})"
        )
        self.assertIn(
            f"{expected} ambiguous: its old lines occur at lines {lines}",
            refused.stderr,
        )
        self.assertEqual(_tree(self.tmp_path), before)

        checked = _overlay("--torch-dir", str(torch_dir), "check")
        self.assertEqual(checked.returncode, 2)
        self.assertIn(f"hunk {number}: AMBIGUOUS at lines {lines}", checked.stdout)
        self.assertEqual(_tree(self.tmp_path), before)

    def test_hunks_without_context_or_out_of_order_are_refused(self):
        # The repository's patches always carry context and keep order: hand-made ones.
        insertion = overlay_tool.parse_diff(
            "--- a/f.py\n+++ b/f.py\n@@ -1,0 +2 @@\n+added\n"
        )[0]
        with self.assertRaisesRegex(
            overlay_tool.OverlayError, r"f.py: hunk 1 .*no old lines"
        ):
            overlay_tool.patch_text("a\n", insertion)
        swapped = overlay_tool.parse_diff(
            "--- a/f.py\n+++ b/f.py\n"
            "@@ -1,2 +1,2 @@\n c\n-d\n+D\n@@ -3,2 +3,2 @@\n a\n-b\n+B\n"
        )[0]
        with self.assertRaisesRegex(
            overlay_tool.OverlayError, r"hunk 2 .* before hunk 1 ends"
        ):
            overlay_tool.patch_text("a\nb\nc\nd\n", swapped)


def _unlisted_install(site: Path) -> Path:
    newest = _newest_minor()
    if newest not in PRISTINE:
        raise unittest.SkipTest(
            f"no pristine torch {newest} files at hand (the newest series)"
        )
    return _fake_install(site, newest, "2.99.0")


class TestUnlistedVersions(OverlayTestCase):
    """A torch whose minor has no series of its own."""

    def test_check_on_an_unlisted_version_tries_the_newest_series(self):
        newest = _newest_minor()
        torch_dir = _unlisted_install(self.tmp_path / "site")
        before = _tree(self.tmp_path)

        checked = _overlay("--torch-dir", str(torch_dir), "check")
        self.assertEqual(checked.returncode, 0, msg=checked.stdout)
        self.assertIn("torch 2.99.0 is not supported", checked.stdout)
        self.assertIn(
            f"checking the newest series, patches/torch-{newest}.series", checked.stdout
        )
        series = _series(newest)
        n_hunks = sum(p.n_hunks for p in series)
        self.assertIn(f"hunks: {n_hunks} of {n_hunks} apply", checked.stdout)
        # Not a venv or system prefix: no Python to run the contracts with.
        self.assertIn("contracts not checked", checked.stdout)
        self.assertTrue(checked.stdout.rstrip().endswith("check: OK"))
        self.assertEqual(_tree(self.tmp_path), before)

        patch, rel, number, hunk = _last_hunk(newest)
        path = torch_dir.parent / rel
        path.write_text(
            path.read_text().replace("".join(hunk.old), "".join(hunk.old[1:]))
        )
        checked = _overlay("--torch-dir", str(torch_dir), "check")
        self.assertEqual(checked.returncode, 2)
        self.assertIn(
            f"hunk {number}: NOT FOUND (the patch's line {hunk.old_start})",
            checked.stdout,
        )

    def test_apply_refuses_an_unlisted_version_unless_forced(self):
        newest = _newest_minor()
        torch_dir = _unlisted_install(self.tmp_path / "site")
        before = _tree(self.tmp_path)

        refused = _overlay("--torch-dir", str(torch_dir), "apply")
        self.assertEqual(refused.returncode, 2)
        supported = ", ".join(f"{v}.x" for v in SUPPORTED)
        self.assertIn(
            f"torch 2.99.0 is not supported (supported: {supported})", refused.stderr
        )
        self.assertIn("`overlay.py check`", refused.stderr)
        self.assertIn("`overlay.py apply --force`", refused.stderr)
        self.assertEqual(_tree(self.tmp_path), before)

        forced = _overlay("--torch-dir", str(torch_dir), "apply", "--force")
        self.assertEqual(forced.returncode, 0, msg=forced.stderr)
        self.assertIn("warning: torch 2.99.0 is not supported", forced.stderr)
        self.assertIn(f"applying patches/torch-{newest}.series", forced.stderr)
        manifest = json.loads((torch_dir / STATE / "manifest.json").read_text())
        self.assertEqual(manifest["series"], newest)
        self.assertEqual(manifest["version"], "2.99.0")
        for rel in manifest["files"]:
            self.assertNotEqual(before[f"site/{rel}"], _exact(torch_dir.parent / rel))
        status = _overlay("--torch-dir", str(torch_dir), "status").stdout
        self.assertIn(f"patches/torch-{newest}.series", status)
        self.assertIn("FORCED", status)
        self.assertNotIn("DRIFT", status)
        again = _overlay("--torch-dir", str(torch_dir), "apply", "--force")
        self.assertIn("already applied", again.stdout)

        removed = _overlay("--torch-dir", str(torch_dir), "remove")
        self.assertEqual(removed.returncode, 0, msg=removed.stderr)
        self.assertIn(f"removed patches/torch-{newest}.series", removed.stdout)
        self.assertEqual(_tree(self.tmp_path), before)

    def test_check_runs_the_contracts_with_the_python_whose_site_packages_holds_the_torch(
        self,
    ):
        venv = self.tmp_path / "venv"
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
        )
        lib = f"python{sys.version_info.major}.{sys.version_info.minor}"
        site = venv / "lib" / lib / "site-packages"
        torch_dir = _unlisted_install(site)

        checked = _overlay("--torch-dir", str(torch_dir), "check")
        self.assertIn(f"python: {venv / 'bin' / lib}\n", checked.stdout)
        self.assertNotIn("none found", checked.stdout)


def _refresh_unchanged(tmp_path: Path, minor: str, tag: str) -> None:
    """Refresh every patch of MINOR's series from a work dir `edit` wrote."""
    for number in dict.fromkeys(p.number for p in _series(minor)):
        work = tmp_path / f"work-{tag}-{number}"
        overlay_tool.edit(minor, PRISTINE[minor][1], work, number)
        overlay_tool.refresh(minor, PRISTINE[minor][1], work, number)


def _contents(patches: Path) -> dict[str, object]:
    """What the series says, whichever part of a patch carries its message: the series
    files, and each patch file's message, trailers (but Message-In) and diff."""
    out: dict[str, object] = {}
    for path in sorted(patches.rglob("*")):
        rel = str(path.relative_to(patches))
        if path.suffix == ".series":
            out[rel] = path.read_text()
        elif path.suffix == ".patch":
            patch = overlay_tool.read_patch(path.name)
            trailers = [
                ln
                for ln in patch.head.splitlines()
                if ln.startswith(("Torch-Minors:", "Other-Part:"))
            ]
            out[rel] = (patch.message, trailers, patch.text.split("\n---\n", 1)[1])
    return out


def _minors_of(patch) -> list[str]:
    return re.search(r"^Torch-Minors: (.+)$", patch.head, re.MULTILINE).group(1).split()


class TestEditAndRefresh(OverlayTestCase):
    """Editing a patch of the series, and writing it back (for developers)."""

    def test_edit_writes_what_applies_and_leaves_the_rest_in_rej_files(self):
        minor = _at_hand()
        patch, rel, number, hunk = _last_hunk(minor)
        intact = _fake_install(self.tmp_path / "intact" / "site", minor)
        self.assertEqual(_overlay("--torch-dir", str(intact), "apply").returncode, 0)
        changed = _fake_install(self.tmp_path / "changed" / "site", minor)
        path = changed.parent / rel
        path.write_text(
            path.read_text().replace("".join(hunk.old), "".join(hunk.old[1:]))
        )

        work = self.tmp_path / "work"
        edited = _overlay("edit", minor, str(changed.parent), str(work))
        self.assertEqual(edited.returncode, 0, msg=edited.stderr)
        rej = work / f"{rel}.rej"
        where = f"hunk {number} (the patch's line {hunk.old_start}) not found"
        self.assertIn(f"{patch.label}: {rel}: {where}, left in {rej}", edited.stdout)
        label, header, *body = rej.read_text().splitlines(keepends=True)
        self.assertEqual(label, f"# {patch.label}\n")
        self.assertTrue(header.startswith(f"@@ -{hunk.old_start},"))
        self.assertEqual([line[1:] for line in body if line[:1] in " -"], hunk.old)
        for other in overlay_tool._paths(_series(minor)):
            if other != rel:
                self.assertEqual(
                    _exact(work / other), _exact(intact.parent / other), msg=other
                )

    def test_edit_upto_writes_the_files_as_the_patches_through_it_leave_them(self):
        minor = _at_hand()
        series = _series(minor)
        number = series[0].number
        work = self.tmp_path / "work"
        edited = _overlay(
            "edit", minor, str(PRISTINE[minor][1]), str(work), "--upto", number
        )
        self.assertEqual(edited.returncode, 0, msg=edited.stderr)
        through = [p for p in series if p.number == number]
        texts = {
            rel: (PRISTINE[minor][1] / rel).read_text()
            for rel in overlay_tool._paths(through)
        }
        expected, problems = overlay_tool.apply_series(texts, through)
        self.assertFalse(problems)
        written = sorted(str(p.relative_to(work)) for p in work.rglob("*.py"))
        self.assertEqual(written, sorted(expected))
        for rel, text in expected.items():
            self.assertEqual((work / rel).read_text(), text)

    def test_refresh_unchanged_rewrites_nothing(self):
        patches_copy = self.patches_copy()
        minor = _at_hand()
        before = _contents(patches_copy)
        _refresh_unchanged(self.tmp_path, minor, "first")
        # The same files, messages and diffs (a series written before parts had short
        # headers gets them now); a second refresh rewrites nothing, byte for byte.
        self.assertEqual(_contents(patches_copy), before)
        after = _tree(patches_copy)
        _refresh_unchanged(self.tmp_path, minor, "again")
        self.assertEqual(_tree(patches_copy), after)

    def test_only_one_part_of_a_patch_carries_its_message(self):
        """After refresh, the part shared by the most minors holds the message; every
        other part a short header naming it, and Patch.message gives every part the
        message."""
        patches_copy = self.patches_copy()
        minor = _at_hand()
        numbers = dict.fromkeys(p.number for p in _series(minor))
        messages = {
            number: overlay_tool.read_patch(
                next(n for n in overlay_tool.series_names(minor) if n[:4] == number)
            ).message
            for number in numbers
        }
        for tag in (
            "first",
            "again",
        ):  # the second reads the message through Message-In
            _refresh_unchanged(self.tmp_path, minor, tag)
            for number in numbers:
                parts = [
                    overlay_tool.read_patch(p.name)
                    for p in sorted(patches_copy.glob(f"series/{number}-*.patch"))
                ]
                message = messages[number]
                why = message[message.index("Why:") :].split("\n\n", 1)[0]
                holders = [p for p in parts if why in p.head]
                self.assertEqual(len(holders), 1, msg=str([p.name for p in holders]))
                main = holders[0]
                self.assertIsNone(main.message_in)
                self.assertEqual(
                    len(_minors_of(main)), max(len(_minors_of(p)) for p in parts)
                )
                subject = message.splitlines()[0]
                for part in parts:
                    self.assertEqual(part.message, message, msg=part.name)
                    if part is main:
                        continue
                    self.assertEqual(part.message_in, main.name)
                    which = part.name.split(".torch-")[1][: -len(".patch")]
                    self.assertTrue(
                        part.head.startswith(f"{subject} (torch {which} part)\n\n")
                    )
                    self.assertIn(f"\nMessage-In: {main.name}", part.head)
                    self.assertNotIn("Behaviour:", part.head)

    def test_refresh_splits_a_shared_hunk_into_per_minor_parts(self):
        """A change made on one minor to a hunk every minor shares: that minor's part
        holds the new hunk, the others' the old one; each series names its parts."""
        self.patches_copy()
        minor = _at_hand()
        pristine = PRISTINE[minor][1]
        shared = next(
            p
            for p in _series(minor)
            if all(p.name in overlay_tool.series_names(m) for m in SUPPORTED)
        )
        number, fp = shared.number, shared.files[0]
        work = self.tmp_path / "work"
        overlay_tool.edit(minor, pristine, work, number)
        path = work / fp.path
        marker = "# a line added on one minor only\n"
        text = path.read_text()
        at = text.index("".join(fp.hunks[0].new)) + len("".join(fp.hunks[0].new))
        path.write_text(text[:at] + marker + text[at:])
        others = {m: overlay_tool.series_names(m) for m in SUPPORTED if m != minor}
        old_hunks = {
            m: {
                overlay_tool._hunk_key(f.path, h)
                for n in names
                if n.startswith(f"{number}-")
                for f in overlay_tool.read_patch(n).files
                for h in f.hunks
            }
            for m, names in others.items()
        }

        overlay_tool.refresh(minor, pristine, work, number)

        mine = [
            n for n in overlay_tool.series_names(minor) if n.startswith(f"{number}-")
        ]
        own_part = [n for n in mine if n.endswith(f".torch-{minor}.patch")]
        self.assertTrue(own_part, msg=mine)
        self.assertIn(marker, overlay_tool.read_patch(own_part[0]).text)
        for m in others:
            now = [
                n for n in overlay_tool.series_names(m) if n.startswith(f"{number}-")
            ]
            hunks = {
                overlay_tool._hunk_key(f.path, h)
                for n in now
                for f in overlay_tool.read_patch(n).files
                for h in f.hunks
            }
            self.assertEqual(hunks, old_hunks[m])  # the other minors' text is unchanged
            self.assertTrue(
                all(marker not in overlay_tool.read_patch(n).text for n in now)
            )
        texts = {
            rel: (pristine / rel).read_text()
            for rel in overlay_tool._paths(_series(minor))
        }
        through = [p for p in _series(minor) if p.number <= number]
        result, problems = overlay_tool.apply_series(texts, through)
        self.assertFalse(problems)
        self.assertEqual(result[fp.path], path.read_text())

    def test_write_concern_stores_each_hunk_once_in_the_file_of_its_minors(self):
        patches_copy = self.patches_copy()

        def diff(*hunks: str) -> list:
            return overlay_tool.parse_diff("--- a/f.py\n+++ b/f.py\n" + "".join(hunks))

        every = "@@ -1,2 +1,2 @@\n a\n-b\n+B\n"
        pair = "@@ -5,2 +5,2 @@\n e\n-f\n+F\n"
        alone_11 = "@@ -5,2 +5,2 @@\n e\n-g\n+G\n"
        names = overlay_tool.write_concern(
            "0009",
            "demo",
            "Subject: [PATCH] demo\n\nWhy: a test.\n\nBehaviour: none.\n",
            {
                "2.11": diff(every, alone_11),
                "2.13": diff(every, pair),
                "2.14": diff(every, pair),
            },
        )
        self.assertEqual(
            names,
            {
                "2.11": ["0009-demo.patch", "0009-demo.torch-2.11.patch"],
                "2.13": ["0009-demo.patch", "0009-demo.torch-2.13+2.14.patch"],
                "2.14": ["0009-demo.patch", "0009-demo.torch-2.13+2.14.patch"],
            },
        )
        files = {p.name: p.read_text() for p in patches_copy.glob("series/0009-*")}
        self.assertTrue(
            files["0009-demo.patch"].endswith("---\n--- a/f.py\n+++ b/f.py\n" + every)
        )
        self.assertIn("Torch-Minors: 2.11 2.13 2.14\n", files["0009-demo.patch"])
        self.assertTrue(files["0009-demo.torch-2.13+2.14.patch"].endswith(pair))
        self.assertTrue(files["0009-demo.torch-2.11.patch"].endswith(alone_11))
        message = "Subject: [PATCH] demo\n\nWhy: a test.\n\nBehaviour: none.\n"
        self.assertTrue(files["0009-demo.patch"].startswith(message))
        self.assertNotIn("Message-In", files["0009-demo.patch"])
        self.assertTrue(
            files["0009-demo.torch-2.11.patch"].startswith(
                "Subject: [PATCH] demo (torch 2.11 part)\n\n"
                "These are the hunks of the patch whose upstream text only torch 2.11 has; "
                "its message is\nin 0009-demo.patch.\n\n"
                "Torch-Minors: 2.11\n"
                "Other-Part: 0009-demo.patch\n"
                "Other-Part: 0009-demo.torch-2.13+2.14.patch\n"
                "Message-In: 0009-demo.patch\n---\n"
            )
        )
        for name in files:
            self.assertTrue("Why:" not in files[name] or name == "0009-demo.patch")
            self.assertEqual(overlay_tool.read_patch(name).message, message)
        for minor in ("2.11", "2.13"):
            patches = [overlay_tool.read_patch(n) for n in names[minor]]
            out, problems = overlay_tool.apply_series(
                {"f.py": "a\nb\nc\nd\ne\n" + ("g\n" if minor == "2.11" else "f\n")},
                patches,
            )
            self.assertFalse(problems)
            self.assertEqual(out["f.py"].splitlines()[1], "B")

    def test_write_concern_keeps_each_part_in_the_files_order(self):
        """A minor's hunks read back from its parts come part by part: a hunk that moves
        into a shared part must still land at its place in the file, or the part does
        not apply (found there in a refresh of patch 0001)."""
        patches_copy = self.patches_copy()

        def diff(*hunks: str) -> list:
            return overlay_tool.parse_diff("--- a/f.py\n+++ b/f.py\n" + "".join(hunks))

        early = "@@ -1,2 +1,2 @@\n a\n-b\n+B\n"
        late = "@@ -5,2 +5,2 @@\n e\n-f\n+F\n"
        names = overlay_tool.write_concern(
            "0009",
            "demo",
            "Subject: [PATCH] demo\n\nWhy: a test.\n\nBehaviour: none.\n",
            {"2.13": diff(early, late), "2.14": diff(late, early)},
        )
        self.assertEqual(names["2.14"], ["0009-demo.patch"])
        text = (patches_copy / "series" / "0009-demo.patch").read_text()
        self.assertTrue(text.endswith("--- a/f.py\n+++ b/f.py\n" + early + late))
        out, problems = overlay_tool.apply_series(
            {"f.py": "a\nb\nc\nd\ne\nf\n"},
            [overlay_tool.read_patch("0009-demo.patch")],
        )
        self.assertFalse(problems)
        self.assertEqual(out["f.py"], "a\nB\nc\nd\ne\nF\n")

    def test_a_port_gets_a_series_of_its_own_that_later_refreshes_keep(self):
        patches_copy = self.patches_copy()
        newest = _newest_minor()
        if newest not in PRISTINE:
            self.skipTest(
                f"no pristine torch {newest} files at hand (the newest series)"
            )
        pristine = PRISTINE[newest][1]
        first = _series(newest)[0]
        fp = first.files[0]
        work = self.tmp_path / "port"
        # 2.99 has no series yet: edit takes the newest's patches.
        overlay_tool.edit("2.99", pristine, work, first.number)
        path = work / fp.path
        marker = "# a line only the port has\n"
        text = path.read_text()
        at = text.index("".join(fp.hunks[0].new)) + len("".join(fp.hunks[0].new))
        path.write_text(text[:at] + marker + text[at:])

        overlay_tool.refresh("2.99", pristine, work, first.number)
        port = overlay_tool.series_names("2.99")
        self.assertTrue(port)
        self.assertTrue(all(n.startswith(f"{first.number}-") for n in port))
        self.assertTrue(any(marker in overlay_tool.read_patch(n).text for n in port))
        texts = {
            rel: (pristine / rel).read_text()
            for rel in overlay_tool._paths(_series(newest))
        }
        result, problems = overlay_tool.apply_series(
            texts, overlay_tool.read_series("2.99")
        )
        self.assertFalse(problems)
        self.assertEqual(result[fp.path], path.read_text())

        # Refreshing the newest's own patch, unchanged, keeps the port's part.
        again = self.tmp_path / "newest"
        overlay_tool.edit(newest, pristine, again, first.number)
        overlay_tool.refresh(newest, pristine, again, first.number)
        self.assertEqual(overlay_tool.series_names("2.99"), port)
        self.assertTrue(all((patches_copy / "series" / n).is_file() for n in port))


instantiate_parametrized_tests(TestApplyAndRemove)


if __name__ == "__main__":
    run_tests()
