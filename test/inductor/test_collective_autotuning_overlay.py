"""tools/overlay.py on fake torch installs: apply, remove, status, check, edit.

Imports only pytest, the standard library and torch (for its version and location): the
other test modules import the overlay's own modules, which need it applied. Every case
runs the tool as a subprocess on a fake install under tmp_path (a site folder holding the
upstream files a diff edits and a version.py), except the one that needs a diff of its
own, which calls the tool's functions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch


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


def _diff(minor: str) -> Path:
    return REPO / "patches" / f"torch-{minor}.diff"


def _newest_minor() -> str:
    """The diff an unsupported torch gets: the newest supported one in this checkout."""
    present = [m for m in SUPPORTED if _diff(m).is_file()]
    return max(present, key=lambda m: tuple(int(p) for p in m.split(".")))


def _hunks(minor: str) -> dict[str, list[tuple[int, list[str]]]]:
    """Each file of the diff: its hunks' first old line and old lines (context, removed)."""
    files: dict[str, list[tuple[int, list[str]]]] = {}
    for line in _diff(minor).read_text().splitlines(keepends=True):
        if line.startswith("+++ b/"):
            hunks = files.setdefault(line[len("+++ b/") :].rstrip("\n"), [])
        elif line.startswith("@@ -"):
            hunks.append((int(line[len("@@ -") :].split(",")[0].split(" ")[0]), []))
        elif line[:1] in (" ", "-") and not line.startswith("--- a/"):
            hunks[-1][1].append(line[1:])
    return files


def _write_version(torch_dir: Path, version: str) -> None:
    (torch_dir / "version.py").write_text(f"__version__ = '{version}'\n")


def _fake_install(root: Path, version: str, pristine: Path) -> Path:
    """A torch package directory holding only the upstream files the overlay edits."""
    torch_dir = root / "site" / "torch"
    for rel in _hunks(_minor(version)):
        (root / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pristine / rel, root / "site" / rel)
    _write_version(torch_dir, version)
    return torch_dir


def _synthetic_install(site: Path, version: str, minor: str) -> Path:
    """A torch whose files are MINOR's diff's old lines, each hunk at the diff's line, in
    numbered filler: what a torch of another version looks like where the diff applies.
    For the unlisted version's cases, which need the newest diff's files at hand."""
    for rel, hunks in _hunks(minor).items():
        lines: list[str] = []
        for start, old in hunks:
            lines += [f"# upstream line {n}\n" for n in range(len(lines) + 1, start)]
            lines += old
        lines.append("# upstream's last line\n")
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("".join(lines))
    _write_version(site / "torch", version)
    return site / "torch"


def _overlay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def _tree(root: Path) -> dict[str, bytes | str | None]:
    """Everything under ROOT: a file's bytes, a link's target, None for a folder."""
    tree: dict[str, bytes | str | None] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            tree[rel] = os.readlink(path)
        else:
            tree[rel] = None if path.is_dir() else path.read_bytes()
    return tree


def _pristine_roots() -> list:
    """One case per supported minor: its version and a folder of its pristine files, or a
    skip saying what is not at hand."""
    installed = _minor(torch.__version__)
    shared = REPO.parent / "shared" / "upstream" / "torch-2.11.0"
    state = Path(torch.__file__).parent / STATE / "pristine"
    roots = []
    for minor in SUPPORTED:
        if not _diff(minor).is_file():
            reason = f"no patches/torch-{minor}.diff in this checkout"
            roots.append(pytest.param(None, None, id=minor, marks=pytest.mark.skip(reason)))
        elif minor == "2.11" and shared.is_dir():
            roots.append(pytest.param("2.11.0", shared, id=minor))
        elif minor == installed:
            site = state if state.is_dir() else Path(torch.__file__).parent.parent
            roots.append(pytest.param(torch.__version__, site, id=minor))
        else:
            reason = f"no pristine torch {minor} files at hand"
            roots.append(pytest.param(None, None, id=minor, marks=pytest.mark.skip(reason)))
    return roots


def _at_hand() -> tuple[str, Path]:
    """The first supported version whose diff and pristine files are at hand."""
    for param in _pristine_roots():
        if not param.marks:
            return param.values
    pytest.skip("no supported torch's diff and pristine files at hand")


def _last_hunk(minor: str) -> tuple[str, int, int, list[str]]:
    """The diff's last file, the number of its last hunk, that hunk's line and old lines."""
    rel, hunks = list(_hunks(minor).items())[-1]
    start, old = hunks[-1]
    return rel, len(hunks), start, old


# -- apply and remove ---------------------------------------------------------------------


@pytest.mark.parametrize("version,pristine", _pristine_roots())
def test_overlay_round_trip_restores_pristine_files(tmp_path, version, pristine):
    minor = _minor(version)
    torch_dir = _fake_install(tmp_path, version, pristine)
    before = _tree(tmp_path)

    applied = _overlay("--torch-dir", str(torch_dir), "apply")
    assert applied.returncode == 0, applied.stderr
    assert f"patches/torch-{minor}.diff" in applied.stdout and not applied.stderr
    manifest = json.loads((torch_dir / STATE / "manifest.json").read_text())
    assert manifest["diff"] == minor
    assert sorted(manifest["files"]) == sorted(_hunks(minor))
    for rel in manifest["files"]:
        assert before[f"site/{rel}"] != (torch_dir.parent / rel).read_bytes()
    for rel in manifest["links"]:
        assert (torch_dir.parent / rel).resolve() == REPO / rel
    assert "already applied" in _overlay("--torch-dir", str(torch_dir), "apply").stdout
    status = _overlay("--torch-dir", str(torch_dir), "status").stdout
    assert f"patches/torch-{minor}.diff" in status
    assert "DRIFT" not in status and "STALE" not in status and "FORCED" not in status
    # On an applied torch, `check` reads the pristine copies: every hunk as in the diff.
    checked = _overlay("--torch-dir", str(torch_dir), "check")
    assert checked.returncode == 0, checked.stdout
    assert "checking the pristine copies" in checked.stdout
    n_hunks = sum(len(hunks) for hunks in _hunks(minor).values())
    assert checked.stdout.count("(as in the diff)") == n_hunks

    removed = _overlay("--torch-dir", str(torch_dir), "remove")
    assert removed.returncode == 0, removed.stderr
    assert f"patches/torch-{minor}.diff" in removed.stdout
    assert _tree(tmp_path) == before


def test_hunk_found_at_an_offset_applies_and_removes_byte_exactly(tmp_path):
    version, pristine = _at_hand()
    minor = _minor(version)
    rel, hunks = list(_hunks(minor).items())[0]
    plain = _fake_install(tmp_path / "plain", version, pristine)
    assert _overlay("--torch-dir", str(plain), "apply").returncode == 0
    patched_in_place = (plain.parent / rel).read_text()

    torch_dir = _fake_install(tmp_path / "moved", version, pristine)
    moved = torch_dir.parent / rel
    added = "".join(f"# a line upstream added above the hunks {n}\n" for n in range(5))
    moved.write_text(added + moved.read_text())
    before = _tree(tmp_path / "moved")

    checked = _overlay("--torch-dir", str(torch_dir), "check")
    assert checked.returncode == 0, checked.stdout
    start = hunks[0][0]
    assert f"hunk 1: applies at line {start + 5} (+5 from the diff's {start})" in checked.stdout
    assert _tree(tmp_path / "moved") == before

    applied = _overlay("--torch-dir", str(torch_dir), "apply")
    assert applied.returncode == 0, applied.stderr
    assert moved.read_text() == added + patched_in_place
    assert _overlay("--torch-dir", str(torch_dir), "remove").returncode == 0
    assert _tree(tmp_path / "moved") == before


def test_missing_hunk_is_refused_naming_file_and_hunk_with_nothing_changed(tmp_path):
    version, pristine = _at_hand()
    rel, number, start, old = _last_hunk(_minor(version))
    torch_dir = _fake_install(tmp_path, version, pristine)
    # The last file's last hunk: a refusal there shows no earlier file was written.
    path = torch_dir.parent / rel
    block = "".join(old)
    changed = old[: len(old) // 2] + ["# upstream changed this line\n"] + old[len(old) // 2 + 1 :]
    assert path.read_text().count(block) == 1
    path.write_text(path.read_text().replace(block, "".join(changed)))
    before = _tree(tmp_path)

    refused = _overlay("--torch-dir", str(torch_dir), "apply")
    assert refused.returncode == 2
    assert f"{rel}: hunk {number} (the diff's line {start}) not found" in refused.stderr
    assert "nothing changed" in refused.stderr
    assert _tree(tmp_path) == before

    checked = _overlay("--torch-dir", str(torch_dir), "check")
    assert checked.returncode == 2
    assert f"hunk {number}: NOT FOUND (the diff's line {start})" in checked.stdout
    assert checked.stdout.rstrip().endswith("check: FAILED")
    assert _tree(tmp_path) == before


def test_ambiguous_hunk_is_refused_listing_its_candidate_lines(tmp_path):
    version, pristine = _at_hand()
    rel, number, start, old = _last_hunk(_minor(version))
    torch_dir = _fake_install(tmp_path, version, pristine)
    path = torch_dir.parent / rel
    path.write_text("".join(old) + path.read_text())  # the hunk's old lines twice
    before = _tree(tmp_path)
    lines = f"1, {start + len(old)}"

    refused = _overlay("--torch-dir", str(torch_dir), "apply")
    assert refused.returncode == 2
    expected = f"{rel}: hunk {number} (the diff's line {start}) ambiguous"
    assert f"{expected}: its old lines occur at lines {lines}" in refused.stderr
    assert _tree(tmp_path) == before

    checked = _overlay("--torch-dir", str(torch_dir), "check")
    assert checked.returncode == 2
    assert f"hunk {number}: AMBIGUOUS at lines {lines}" in checked.stdout
    assert _tree(tmp_path) == before


def test_hunks_without_context_or_out_of_order_are_refused():
    # The repository's diffs always carry context and keep order: hand-made ones here.
    insertion = overlay_tool.parse_diff("--- a/f.py\n+++ b/f.py\n@@ -1,0 +2 @@\n+added\n")[0]
    with pytest.raises(overlay_tool.OverlayError, match=r"f.py: hunk 1 .*no old lines"):
        overlay_tool.patch_text("a\n", insertion)
    swapped = overlay_tool.parse_diff(
        "--- a/f.py\n+++ b/f.py\n@@ -1,2 +1,2 @@\n c\n-d\n+D\n@@ -3,2 +3,2 @@\n a\n-b\n+B\n"
    )[0]
    with pytest.raises(overlay_tool.OverlayError, match=r"hunk 2 .* before hunk 1 ends"):
        overlay_tool.patch_text("a\nb\nc\nd\n", swapped)


# -- versions without a diff of their own ------------------------------------------------------


def test_check_on_an_unlisted_version_tries_the_newest_diff(tmp_path):
    newest = _newest_minor()
    torch_dir = _synthetic_install(tmp_path / "site", "2.99.0", newest)
    before = _tree(tmp_path)

    checked = _overlay("--torch-dir", str(torch_dir), "check")
    assert checked.returncode == 0, checked.stdout
    assert "torch 2.99.0 is not supported" in checked.stdout
    assert f"checking the newest diff, patches/torch-{newest}.diff" in checked.stdout
    n_hunks = sum(len(hunks) for hunks in _hunks(newest).values())
    assert checked.stdout.count("(as in the diff)") == n_hunks
    assert f"hunks: {n_hunks} of {n_hunks} apply" in checked.stdout
    # Not a venv or system prefix: no Python to run the contracts with.
    assert "contracts not checked" in checked.stdout
    assert checked.stdout.rstrip().endswith("check: OK")
    assert _tree(tmp_path) == before

    rel, number, start, old = _last_hunk(newest)
    path = torch_dir.parent / rel
    path.write_text(path.read_text().replace("".join(old), "".join(old[1:])))
    checked = _overlay("--torch-dir", str(torch_dir), "check")
    assert checked.returncode == 2
    assert f"hunk {number}: NOT FOUND (the diff's line {start})" in checked.stdout


def test_apply_refuses_an_unlisted_version_unless_forced(tmp_path):
    newest = _newest_minor()
    torch_dir = _synthetic_install(tmp_path / "site", "2.99.0", newest)
    before = _tree(tmp_path)

    refused = _overlay("--torch-dir", str(torch_dir), "apply")
    assert refused.returncode == 2
    supported = ", ".join(f"{v}.x" for v in SUPPORTED)
    assert f"torch 2.99.0 is not supported (supported: {supported})" in refused.stderr
    assert "`overlay.py check`" in refused.stderr
    assert "`overlay.py apply --force`" in refused.stderr
    assert _tree(tmp_path) == before

    forced = _overlay("--torch-dir", str(torch_dir), "apply", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "warning: torch 2.99.0 is not supported" in forced.stderr
    assert f"applying patches/torch-{newest}.diff" in forced.stderr
    manifest = json.loads((torch_dir / STATE / "manifest.json").read_text())
    assert manifest["diff"] == newest and manifest["version"] == "2.99.0"
    for rel in manifest["files"]:
        assert before[f"site/{rel}"] != (torch_dir.parent / rel).read_bytes()
    status = _overlay("--torch-dir", str(torch_dir), "status").stdout
    assert f"patches/torch-{newest}.diff" in status and "FORCED" in status
    assert "DRIFT" not in status
    assert "already applied" in _overlay("--torch-dir", str(torch_dir), "apply", "--force").stdout

    removed = _overlay("--torch-dir", str(torch_dir), "remove")
    assert removed.returncode == 0, removed.stderr
    assert f"removed patches/torch-{newest}.diff" in removed.stdout
    assert _tree(tmp_path) == before


def test_check_runs_the_contracts_with_the_python_whose_site_packages_holds_the_torch(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    lib = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = venv / "lib" / lib / "site-packages"
    torch_dir = _synthetic_install(site, "2.99.0", _newest_minor())

    checked = _overlay("--torch-dir", str(torch_dir), "check")
    assert f"python: {venv / 'bin' / lib}\n" in checked.stdout
    assert "none found" not in checked.stdout


# -- editing the diff ---------------------------------------------------------------------------


def test_edit_writes_what_applies_and_leaves_the_rest_in_rej_files(tmp_path):
    version, pristine = _at_hand()
    minor = _minor(version)
    rel, number, start, old = _last_hunk(minor)
    intact = _fake_install(tmp_path / "intact", version, pristine)
    assert _overlay("--torch-dir", str(intact), "apply").returncode == 0
    changed = _fake_install(tmp_path / "changed", version, pristine)
    path = changed.parent / rel
    path.write_text(path.read_text().replace("".join(old), "".join(old[1:])))

    work = tmp_path / "work"
    edited = _overlay("edit", minor, str(changed.parent), str(work))
    assert edited.returncode == 0, edited.stderr
    rej = work / f"{rel}.rej"
    expected = f"{rel}: hunk {number} (the diff's line {start}) not found, left in {rej}"
    assert expected in edited.stdout
    header, *body = rej.read_text().splitlines(keepends=True)
    assert header.startswith(f"@@ -{start},")
    assert [line[1:] for line in body if line[:1] in " -"] == old
    for other in _hunks(minor):
        if other != rel:
            assert (work / other).read_bytes() == (intact.parent / other).read_bytes()
