#!/usr/bin/env python3
"""Lay this repository's Inductor patch onto an installed torch, and take it off again.

    overlay.py [--python PY | --torch-dir DIR] apply [--force] | remove | status | check
    overlay.py edit VERSION PRISTINE_ROOT WORK_ROOT     (developers: see README)
    overlay.py refresh VERSION PRISTINE_ROOT WORK_ROOT

`apply` links every file under this repository's torch/ into the installed torch
(so edits take effect at once) and applies patches/torch-<minor>.diff to the upstream
files it edits, after checking that every hunk applies and before touching anything.
A hunk is found by its content (its context and removed lines), wherever it is in the
file, as long as it occurs exactly once. The pristine upstream files are kept beside the
install and restored byte for byte by `remove`. Both are idempotent; `status` says what
is there.

`check` changes nothing: it says where each hunk of the diff would apply on any torch,
supported or not (an unsupported one is checked against the newest diff), and runs the
upstream contracts of test/inductor/collective_contracts.py with that torch's Python.
`apply --force` applies the newest diff to an unsupported torch when all its hunks apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
SUPPORTED = ("2.11", "2.13", "2.14")
STATE_DIR = ".collective_autotuning_overlay"
CONTRACTS = Path("test") / "inductor" / "collective_contracts.py"


class OverlayError(Exception):
    pass


# -- unified diffs ----------------------------------------------------------------


@dataclasses.dataclass
class Hunk:
    old_start: int  # 1-based, in the file the diff was made against
    old: list[str]
    new: list[str]
    text: str  # as the diff writes it, header included: what `edit` leaves in a .rej file


@dataclasses.dataclass
class FilePatch:
    path: str  # relative to site-packages, e.g. torch/_inductor/config.py
    hunks: list[Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def parse_diff(text: str) -> list[FilePatch]:
    patches: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            patches.append(FilePatch(path.removeprefix("b/"), []))
            i += 2
            continue
        match = _HUNK.match(line)
        if match:
            hunk = Hunk(int(match.group(1)), [], [], "")
            old_count, new_count = (int(g) if g else 1 for g in match.group(2, 3))
            start = i
            i += 1
            # The counts say where the hunk ends ("--- a/next" would read as a removal).
            while i < len(lines) and (
                len(hunk.old) < old_count or len(hunk.new) < new_count or lines[i][:1] == "\\"
            ):
                kind, body = lines[i][:1], lines[i][1:]
                if kind == "\\":  # "\ No newline at end of file" ends the line before
                    previous = lines[i - 1][:1]
                    if previous in (" ", "-"):
                        hunk.old[-1] = hunk.old[-1].rstrip("\n")
                    if previous in (" ", "+"):
                        hunk.new[-1] = hunk.new[-1].rstrip("\n")
                if kind in (" ", "-"):
                    hunk.old.append(body)
                if kind in (" ", "+"):
                    hunk.new.append(body)
                i += 1
            hunk.text = "".join(lines[start:i])
            patches[-1].hunks.append(hunk)
            continue
        i += 1
    return patches


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one hunk's old lines (context and removed) occur in a file."""

    number: int  # 1-based, in the diff's order
    hunk: Hunk
    found: tuple[int, ...]  # 1-based first lines of every occurrence
    # Hunks apply in order and must not overlap: (number, last line) of the hunk placed
    # before this one, when this one is found before that one ends.
    overlaps: tuple[int, int] | None

    @property
    def applies(self) -> bool:
        return len(self.found) == 1 and self.overlaps is None

    @property
    def line(self) -> int:
        """The 1-based line the hunk applies at."""
        return self.found[0]

    def problem(self) -> str:
        """Why the hunk does not apply, for an error message."""
        expected = f"hunk {self.number} (the diff's line {self.hunk.old_start})"
        if not self.hunk.old:
            return (
                f"{expected} has no old lines, so it cannot be found by content; "
                "make the diff with context (diff -u)"
            )
        if not self.found:
            return f"{expected} not found"
        if len(self.found) > 1:
            return f"{expected} ambiguous: its old lines occur at lines {_lines(self.found)}"
        number, end = self.overlaps or (0, 0)
        return f"{expected} found at line {self.line}, before hunk {number} ends (line {end})"

    def report(self) -> str:
        """One line of `check`."""
        if self.applies:
            offset = self.line - self.hunk.old_start
            if not offset:
                return f"hunk {self.number}: applies at line {self.line} (as in the diff)"
            return (
                f"hunk {self.number}: applies at line {self.line} "
                f"({offset:+d} from the diff's {self.hunk.old_start})"
            )
        if not self.hunk.old:
            return f"hunk {self.number}: NO OLD LINES (a pure insertion cannot be found by content)"
        if not self.found:
            return f"hunk {self.number}: NOT FOUND (the diff's line {self.hunk.old_start})"
        if len(self.found) > 1:
            return f"hunk {self.number}: AMBIGUOUS at lines {_lines(self.found)}"
        number, end = self.overlaps or (0, 0)
        return f"hunk {self.number}: OVERLAPS hunk {number} (at line {self.line}, it ends at {end})"


def _lines(numbers: tuple[int, ...]) -> str:
    return ", ".join(str(n) for n in numbers)


def _occurrences(lines: list[str], block: list[str]) -> tuple[int, ...]:
    return tuple(
        i + 1
        for i, line in enumerate(lines)
        if line == block[0] and lines[i : i + len(block)] == block
    )


def place_hunks(lines: list[str], file_patch: FilePatch) -> list[Placement]:
    """Every hunk's place in LINES, searched at any offset like GNU patch (no fuzz)."""
    placements = []
    previous: tuple[int, int] | None = None  # (number, last line) of the last hunk placed
    for number, hunk in enumerate(file_patch.hunks, 1):
        found = _occurrences(lines, hunk.old) if hunk.old else ()
        overlaps = previous if len(found) == 1 and previous and found[0] <= previous[1] else None
        placement = Placement(number, hunk, found, overlaps)
        if placement.applies:
            previous = (number, placement.line + len(hunk.old) - 1)
        placements.append(placement)
    return placements


def splice(lines: list[str], placements: list[Placement]) -> str:
    """LINES with the hunks that apply applied."""
    out: list[str] = []
    cursor = 0
    for p in placements:
        if p.applies:
            out.extend(lines[cursor : p.line - 1])
            out.extend(p.hunk.new)
            cursor = p.line - 1 + len(p.hunk.old)
    out.extend(lines[cursor:])
    return "".join(out)


def patch_text(original: str, file_patch: FilePatch) -> str:
    """The patched text; raises OverlayError naming every hunk that does not apply."""
    lines = original.splitlines(keepends=True)
    placements = place_hunks(lines, file_patch)
    problems = [f"{file_patch.path}: {p.problem()}" for p in placements if not p.applies]
    if problems:
        raise OverlayError("\n".join(problems))
    return splice(lines, placements)


def make_diff(path: str, pristine: Path, edited: Path) -> str:
    result = subprocess.run(
        ["diff", "-u", "--label", f"a/{path}", "--label", f"b/{path}", str(pristine), str(edited)],
        capture_output=True,
        text=True,
    )
    if result.returncode > 1:
        raise OverlayError(result.stderr)
    return result.stdout


# -- the diffs of this repository --------------------------------------------------


def _minor_key(minor: str) -> tuple[int, ...]:
    return tuple(int(part) for part in minor.split("."))


def _diff_path(minor: str) -> Path:
    return PATCHES / f"torch-{minor}.diff"


def _supported_text() -> str:
    return ", ".join(f"{v}.x" for v in SUPPORTED)


def newest_minor() -> str:
    """The newest supported minor whose diff is in this checkout."""
    present = [minor for minor in SUPPORTED if _diff_path(minor).is_file()]
    if not present:
        raise OverlayError(f"no diff for any of {_supported_text()} in {PATCHES}")
    return max(present, key=_minor_key)


def _diff_for(minor: str) -> tuple[str, list[FilePatch]]:
    path = _diff_path(minor)
    if not path.is_file():
        raise OverlayError(f"{path.relative_to(REPO)} is not in this checkout")
    text = path.read_text()
    return text, parse_diff(text)


# -- the installed torch ----------------------------------------------------------


@dataclasses.dataclass
class Install:
    torch_dir: Path
    version: str

    @property
    def site(self) -> Path:
        return self.torch_dir.parent

    @property
    def minor(self) -> str:
        return ".".join(self.version.split("+")[0].split(".")[:2])

    @property
    def state_dir(self) -> Path:
        return self.torch_dir / STATE_DIR

    @property
    def manifest(self) -> Path:
        return self.state_dir / "manifest.json"

    def read_manifest(self) -> dict | None:
        return json.loads(self.manifest.read_text()) if self.manifest.exists() else None

    def not_own_diff(self) -> str | None:
        """Why this torch has no diff of its own here (None: it has)."""
        if self.minor not in SUPPORTED:
            return f"torch {self.version} is not supported (supported: {_supported_text()})"
        if not _diff_path(self.minor).is_file():
            return (
                f"torch {self.minor} is supported, but patches/torch-{self.minor}.diff is "
                "not in this checkout"
            )
        return None


def _torch_dir_of(python: str) -> Path | None:
    # Not from the current folder (`-c` puts it first): this repository's torch/ would do.
    probe = (
        "import sys; sys.path = [p for p in sys.path if p]; import importlib.util as u; "
        "s = u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')"
    )
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()
    return Path(found).resolve() if found else None


def locate(python: str | None, torch_dir: str | None) -> Install:
    if torch_dir is None:
        found = _torch_dir_of(python or sys.executable)
        if found is None:
            raise OverlayError(f"no torch is installed for {python or sys.executable}")
        root = found
    else:
        root = Path(torch_dir).resolve()
    version_file = root / "version.py"
    match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", version_file.read_text(), re.M)
    if not match:
        raise OverlayError(f"cannot read the torch version from {version_file}")
    return Install(root, match.group(1))


def python_of(torch_dir: Path) -> str | None:
    """The Python whose site-packages holds TORCH_DIR (<prefix>/lib/pythonX.Y/site-packages,
    a venv's or a system's), confirmed by asking it where its torch is."""
    lib = torch_dir.parent.parent
    if not (lib.name.startswith("python") and lib.parent.name in ("lib", "lib64")):
        return None
    for name in (lib.name, "python3", "python"):
        candidate = lib.parent.parent / "bin" / name
        if candidate.is_file() and _torch_dir_of(str(candidate)) == torch_dir:
            return str(candidate)
    return None


def our_files() -> list[str]:
    """Files of this repository that are new in torch, relative to site-packages."""
    return sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "torch").rglob("*.py")
        if "__pycache__" not in p.parts
    )


def _clashes(install: Install, links: list[str]) -> list[Path]:
    """Our new files that the installed torch already has as upstream files."""
    return [
        install.site / rel
        for rel in links
        if (install.site / rel).exists() and not (install.site / rel).is_symlink()
    ]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- commands ----------------------------------------------------------------------


def apply(install: Install, force: bool = False) -> str:
    reason = install.not_own_diff()
    if reason and not force:
        raise OverlayError(
            f"{reason}; nothing applied to {install.torch_dir}. Run `overlay.py check` to see "
            f"whether the newest diff (patches/torch-{newest_minor()}.diff) applies and the "
            "upstream contracts hold, then `overlay.py apply --force` to apply it"
        )
    minor = newest_minor() if reason else install.minor
    if reason:
        print(
            f"overlay: warning: {reason}; --force: applying patches/torch-{minor}.diff, "
            f"made for torch {minor}",
            file=sys.stderr,
        )
    diff_text, file_patches = _diff_for(minor)
    links = our_files()
    manifest = install.read_manifest()
    if (
        manifest is not None
        and manifest.get("diff") == minor
        and manifest["diff_sha"] == _sha(diff_text.encode())
        and manifest["links"] == links
        and not _drift(install, manifest)
    ):
        return f"already applied to torch {install.version} at {install.torch_dir}"
    # Check everything before touching anything (an older overlay included).
    patched: dict[str, str] = {}
    problems: list[str] = []
    for fp in file_patches:
        source = _upstream(install, manifest, fp.path)
        if not source.is_file():
            problems.append(f"{fp.path}: not in this torch")
            continue
        try:
            patched[fp.path] = patch_text(source.read_text(), fp)
        except OverlayError as e:
            problems.append(str(e))
    if problems:
        raise OverlayError(
            f"patches/torch-{minor}.diff does not apply to torch {install.version} at "
            f"{install.torch_dir} (its files differ from those the diff was made against); "
            "nothing changed:\n  " + "\n  ".join(problems)
        )
    clashes = _clashes(install, links)
    if clashes:
        raise OverlayError(
            f"{', '.join(map(str, clashes))}: in the installed torch and not ours; refusing "
            "to replace upstream files"
        )
    if manifest is not None:
        remove(install)
    pristine_root = install.state_dir / "pristine"
    files = {}
    for rel, text in patched.items():
        path = install.site / rel
        original = path.read_bytes()
        backup = pristine_root / rel
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_bytes(original)
        path.write_text(text)
        files[rel] = {"pristine": _sha(original), "patched": _sha(text.encode())}
    # Folders made for links (none in a real torch, which has them all) go with `remove`.
    made = sorted(
        str(d.relative_to(install.site))
        for d in {parent for rel in links for parent in (install.site / rel).parents}
        if d.is_relative_to(install.site) and not d.exists()
    )
    for rel in links:
        target = install.site / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink():
            target.unlink()
        target.symlink_to(REPO / rel)
    install.manifest.write_text(
        json.dumps(
            {
                "version": install.version,
                "repo": str(REPO),
                "diff": minor,
                "diff_sha": _sha(diff_text.encode()),
                "files": files,
                "links": links,
                "made_dirs": made,
            },
            indent=2,
        )
    )
    return (
        f"applied patches/torch-{minor}.diff to torch {install.version} at "
        f"{install.torch_dir}: patched {len(files)} upstream files, linked {len(links)} new files"
    )


def _upstream(install: Install, manifest: dict | None, rel: str) -> Path:
    """The upstream file REL as it was before the overlay patched it, if it did."""
    if manifest is not None and rel in manifest["files"]:
        return install.state_dir / "pristine" / rel
    return install.site / rel


def _applied_diff(install: Install, manifest: dict) -> str:
    # Manifests written before --force existed name no diff: theirs was the torch's own.
    return manifest.get("diff", install.minor)


def remove(install: Install) -> str:
    manifest = install.read_manifest()
    if manifest is None:
        return f"not applied to torch {install.version} at {install.torch_dir}"
    pristine_root = install.state_dir / "pristine"
    for rel, shas in manifest["files"].items():
        backup = (pristine_root / rel).read_bytes()
        if _sha(backup) != shas["pristine"]:
            raise OverlayError(f"the saved pristine copy of {rel} is damaged; not restoring")
        (install.site / rel).write_bytes(backup)
    for rel in manifest["links"]:
        target = install.site / rel
        if target.is_symlink():
            target.unlink()
    for rel in sorted(manifest.get("made_dirs", []), reverse=True):  # innermost first
        if not any((install.site / rel).iterdir()):
            (install.site / rel).rmdir()
    shutil.rmtree(install.state_dir)
    return (
        f"removed patches/torch-{_applied_diff(install, manifest)}.diff from torch "
        f"{install.version} at {install.torch_dir}; upstream files restored"
    )


def _drift(install: Install, manifest: dict) -> list[str]:
    """What differs from what `apply` left."""
    problems = []
    for rel, shas in manifest["files"].items():
        if _sha((install.site / rel).read_bytes()) != shas["patched"]:
            problems.append(f"{rel} changed since the overlay patched it")
    for rel in manifest["links"]:
        target = install.site / rel
        linked = (Path(manifest["repo"]) / rel).resolve()
        if not (target.is_symlink() and target.resolve() == linked):
            problems.append(f"{rel} is not linked to the repository")
    return problems


def status(install: Install) -> str:
    head = f"torch {install.version} at {install.torch_dir}"
    reason = install.not_own_diff()
    manifest = install.read_manifest()
    if manifest is None:
        if reason:
            return f"{head}: {reason}; `overlay.py check` says whether the newest diff applies"
        return f"{head}: overlay not applied"
    minor = _applied_diff(install, manifest)
    lines = [f"{head}: overlay applied from {manifest['repo']}, patches/torch-{minor}.diff"]
    lines += [f"  FORCED  {reason}"] if reason else []
    lines += [f"  patched {rel}" for rel in manifest["files"]]
    lines += [f"  linked  {rel}" for rel in manifest["links"]]
    lines += [f"  DRIFT   {p}" for p in _drift(install, manifest)]
    diff = _diff_path(minor)
    if not diff.is_file() or _sha(diff.read_bytes()) != manifest["diff_sha"]:
        lines.append("  STALE   the repository's diff changed since; run apply again")
    return "\n".join(lines)


def check(install: Install, python: str | None) -> tuple[str, bool]:
    """Where each hunk would apply, and whether the upstream contracts hold; the report
    and whether all is well. Reads only."""
    reason = install.not_own_diff()
    minor = newest_minor() if reason else install.minor
    _, file_patches = _diff_for(minor)
    manifest = install.read_manifest()
    lines = [
        f"torch {install.version} at {install.torch_dir}",
        f"python: {python or 'none found whose site-packages holds this torch'}",
    ]
    if reason:
        lines.append(f"{reason}; checking the newest diff, patches/torch-{minor}.diff")
    else:
        lines.append(f"checking its own diff, patches/torch-{minor}.diff")
    if manifest is not None:
        # `apply` would patch the pristine files again, not the patched ones.
        lines.append("the overlay is applied: checking the pristine copies it keeps")
    failing = 0
    for fp in file_patches:
        lines.append(fp.path)
        source = _upstream(install, manifest, fp.path)
        if not source.is_file():
            lines.append(f"  MISSING from this torch: none of its {len(fp.hunks)} hunks applies")
            failing += len(fp.hunks)
            continue
        placements = place_hunks(source.read_text().splitlines(keepends=True), fp)
        lines += [f"  {p.report()}" for p in placements]
        failing += sum(not p.applies for p in placements)
    links = our_files()
    clashes = _clashes(install, links)
    lines.append(f"new files: {len(links)} to link, {len(clashes)} clash with upstream files")
    lines += [f"  CLASH   {path}" for path in clashes]
    total = sum(len(fp.hunks) for fp in file_patches)
    lines.append(f"hunks: {total - failing} of {total} apply")
    contracts_hold = True
    if not (REPO / CONTRACTS).is_file():
        lines.append(f"contracts not checked: {CONTRACTS} is not in this checkout")
    elif python is None:
        lines.append(
            f"contracts not checked: no Python found whose site-packages holds "
            f"{install.torch_dir}; pass --python"
        )
    else:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(REPO / "test" / "inductor"), env.get("PYTHONPATH")])
        )
        run = subprocess.run(
            [python, str(CONTRACTS)], cwd=REPO, env=env, capture_output=True, text=True
        )
        lines.append(f"contracts ({python} {CONTRACTS}):")
        lines += [f"  {line}" for line in (run.stdout + run.stderr).splitlines()]
        contracts_hold = run.returncode == 0
        if run.returncode not in (0, 1):
            lines.append(f"  the contract script itself failed (exit {run.returncode})")
    ok = failing == 0 and not clashes and contracts_hold
    lines.append("check: OK" if ok else "check: FAILED")
    return "\n".join(lines), ok


def edit(minor: str, pristine_root: Path, work_root: Path) -> str:
    """Write the patched upstream files under WORK_ROOT, for editing by hand. A hunk that
    does not apply is left in <file>.rej beside its file, to port by hand."""
    _, file_patches = _diff_for(minor)
    rejected = []
    for fp in file_patches:
        lines = (pristine_root / fp.path).read_text().splitlines(keepends=True)
        placements = place_hunks(lines, fp)
        dst = work_root / fp.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(splice(lines, placements))
        failed = [p for p in placements if not p.applies]
        rej = dst.with_name(dst.name + ".rej")
        rej.unlink(missing_ok=True)  # an earlier edit's rejects are not this one's
        if failed:
            rej.write_text("".join(p.hunk.text for p in failed))
            rejected += [f"  {fp.path}: {p.problem()}, left in {rej}" for p in failed]
    head = f"patched copies of {len(file_patches)} files written under {work_root}"
    if not rejected:
        return head
    return "\n".join(
        [f"{head}; hunks that did not apply, to port by hand before `refresh`:"]
        + rejected
    )


def refresh(minor: str, pristine_root: Path, work_root: Path) -> str:
    """Regenerate patches/torch-MINOR.diff from the edited files under WORK_ROOT."""
    edited = sorted(
        str(p.relative_to(work_root)) for p in work_root.rglob("*.py") if p.is_file()
    )
    text = "".join(make_diff(rel, pristine_root / rel, work_root / rel) for rel in edited)
    _diff_path(minor).write_text(text)
    return f"patches/torch-{minor}.diff: {len(parse_diff(text))} files"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--python", help="the Python whose torch to patch (default: this one)")
    parser.add_argument("--torch-dir", help="the torch package directory to patch")
    parser.add_argument(
        "--force", action="store_true", help="apply: the newest diff to an unsupported torch"
    )
    parser.add_argument(
        "command", choices=["apply", "remove", "status", "check", "edit", "refresh"]
    )
    parser.add_argument("args", nargs="*")
    opts = parser.parse_args(argv)
    if opts.force and opts.command != "apply":
        parser.error("--force goes with apply only")
    try:
        if opts.command in ("edit", "refresh"):
            minor, pristine, work = opts.args
            fn = edit if opts.command == "edit" else refresh
            print(fn(minor, Path(pristine), Path(work)))
            return 0
        install = locate(opts.python, opts.torch_dir)
        if opts.command == "check":
            if opts.python:
                python = opts.python
            else:
                python = python_of(install.torch_dir) if opts.torch_dir else sys.executable
            report, ok = check(install, python)
            print(report)
            return 0 if ok else 2
        if opts.command == "apply":
            print(apply(install, opts.force))
        else:
            print({"remove": remove, "status": status}[opts.command](install))
        return 0
    except OverlayError as e:
        print(f"overlay: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
