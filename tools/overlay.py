#!/usr/bin/env python3
"""Lay this repository's Inductor patch onto an installed torch, and take it off again.

    overlay.py [--python PY | --torch-dir DIR] apply [--force] | remove | status | check
    overlay.py edit MINOR PRISTINE_ROOT WORK_ROOT [--upto NNNN]   (developers)
    overlay.py refresh MINOR PRISTINE_ROOT WORK_ROOT NNNN

The patch is a series, one concern per patch: patches/series/NNNN-<slug>*.patch, each a
message (Subject, why, what changes in behaviour) then a unified diff. Minors share a
patch's text: NNNN-<slug>.patch holds the hunks every minor of that patch shares, and
NNNN-<slug>.torch-<minors>.patch the hunks whose upstream text only those minors have
(its Torch-Minors trailer says which; Other-Part names the rest of the patch). Only the
part shared by the most minors carries the message; every other part has a short header
whose Message-In trailer names that part.
patches/torch-<minor>.series lists the files that apply to a minor, in order.

`apply` links every file under this repository's torch/ into the installed torch (so
edits take effect at once) and applies the minor's series to the upstream files, patch
after patch, after checking that every hunk of every patch applies and before touching
anything. A hunk is found by its content (its context and removed lines), wherever it
is in the file as the patches before it left it, as long as it occurs exactly once. The
pristine upstream files are kept beside the install and restored byte for byte by
`remove`. Both are idempotent; `status` says which patches are applied and what drifted.

`check` changes nothing: it says where each hunk of each patch would apply on any torch,
supported or not (an unsupported one is checked against the newest series), and runs
the upstream contracts of test/inductor/collective_contracts.py with that torch's
Python. `apply --force` applies the newest series to an unsupported torch when all of
it applies.

Developers change patch NNNN of a minor in three steps: `edit MINOR PRISTINE WORK --upto
NNNN` writes the pristine files with the series applied through NNNN (a hunk that does
not apply is left in <file>.rej); edit the files under WORK; `refresh MINOR PRISTINE
WORK NNNN` makes patch NNNN the difference between the series before NNNN and WORK,
keeps its message, shares its hunks again with the other minors and rewrites the series
files. For a minor without a series (a port), both take the newest series' patches for
the numbers it has none of yet; refresh its patches in order.
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
import tempfile
import textwrap
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
SERIES = PATCHES / "series"
SUPPORTED = ("2.11", "2.13", "2.14", "2.15")
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
    text: (
        str  # as the diff writes it, header included: what `edit` leaves in a .rej file
    )


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
        if (
            line.startswith("--- ")
            and i + 1 < len(lines)
            and lines[i + 1].startswith("+++ ")
        ):
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
                len(hunk.old) < old_count
                or len(hunk.new) < new_count
                or lines[i][:1] == "\\"
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
        expected = f"hunk {self.number} (the patch's line {self.hunk.old_start})"
        if not self.hunk.old:
            return (
                f"{expected} has no old lines, so it cannot be found by content; "
                "make the diff with context (diff -u)"
            )
        if not self.found:
            return f"{expected} not found"
        if len(self.found) > 1:
            lines = _lines(self.found)
            return f"{expected} ambiguous: its old lines occur at lines {lines}"
        number, end = self.overlaps or (0, 0)
        return (
            f"{expected} found at line {self.line}, before hunk {number} ends "
            f"(line {end})"
        )

    def report(self) -> str:
        """One line of `check`."""
        if self.applies:
            offset = self.line - self.hunk.old_start
            if not offset:
                return (
                    f"hunk {self.number}: applies at line {self.line} (as in the patch)"
                )
            return (
                f"hunk {self.number}: applies at line {self.line} "
                f"({offset:+d} from the patch's {self.hunk.old_start})"
            )
        if not self.hunk.old:
            return (
                f"hunk {self.number}: NO OLD LINES "
                "(a pure insertion cannot be found by content)"
            )
        if not self.found:
            start = self.hunk.old_start
            return f"hunk {self.number}: NOT FOUND (the patch's line {start})"
        if len(self.found) > 1:
            return f"hunk {self.number}: AMBIGUOUS at lines {_lines(self.found)}"
        number, end = self.overlaps or (0, 0)
        return (
            f"hunk {self.number}: OVERLAPS hunk {number} "
            f"(at line {self.line}, it ends at {end})"
        )


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
    previous: tuple[int, int] | None = (
        None  # (number, last line) of the last hunk placed
    )
    for number, hunk in enumerate(file_patch.hunks, 1):
        found = _occurrences(lines, hunk.old) if hunk.old else ()
        overlaps = (
            previous
            if len(found) == 1 and previous and found[0] <= previous[1]
            else None
        )
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
    problems = [
        f"{file_patch.path}: {p.problem()}" for p in placements if not p.applies
    ]
    if problems:
        raise OverlayError("\n".join(problems))
    return splice(lines, placements)


def make_diff(path: str, pristine: Path, edited: Path) -> str:
    result = subprocess.run(
        [
            "diff",
            "-u",
            "--label",
            f"a/{path}",
            "--label",
            f"b/{path}",
            str(pristine),
            str(edited),
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode > 1:
        raise OverlayError(result.stderr)
    return result.stdout


# -- the patch series of this repository --------------------------------------------


_NUMBER = re.compile(r"^(\d{4})-([a-z0-9-]+?)(?:\.torch-([0-9.+]+))?\.patch$")
_MINORS_TRAILER = "Torch-Minors:"  # the trailers write_concern adds to a message
_PARTS_TRAILER = "Other-Part:"
_MESSAGE_TRAILER = "Message-In:"  # a part without the message: the part that has it
_TRAILERS = (_MINORS_TRAILER, _PARTS_TRAILER, _MESSAGE_TRAILER)


def _strip_trailers(head: str) -> str:
    kept = [ln for ln in head.splitlines() if not ln.startswith(_TRAILERS)]
    return "\n".join(kept).rstrip() + "\n"


@dataclasses.dataclass
class Patch:
    """One file of patches/series/: a message, then a unified diff."""

    name: str  # e.g. 0002-inductor-drop-collective-benchmarking.torch-2.11.patch
    text: str
    files: list[FilePatch]

    @property
    def number(self) -> str:
        return self.name[:4]

    @property
    def slug(self) -> str:
        match = _NUMBER.match(self.name)
        return match.group(2) if match else self.name

    @property
    def label(self) -> str:
        return f"patches/series/{self.name}"

    @property
    def head(self) -> str:
        """What this file holds before the diff: a message or a short header, then the
        trailers."""
        return self.text.split("\n---\n", 1)[0]

    @property
    def message_in(self) -> str | None:
        """The part of this patch that holds its message, when this part holds only a
        short header (its Message-In trailer); None when this part holds it."""
        for line in self.head.splitlines():
            if line.startswith(_MESSAGE_TRAILER):
                return line[len(_MESSAGE_TRAILER) :].strip()
        return None

    @property
    def message(self) -> str:
        """The patch's message, without the trailers write_concern adds: this part's
        header, or, for a part with a short header, the message of the part its
        Message-In names."""
        main = self.message_in
        if main is None:
            return _strip_trailers(self.head)
        holder = read_patch(main)
        if holder.message_in is not None:
            raise OverlayError(
                f"{self.label}: its message is in {main}, which has no message either "
                f"(Message-In: {holder.message_in})"
            )
        return _strip_trailers(holder.head)

    @property
    def n_hunks(self) -> int:
        return sum(len(fp.hunks) for fp in self.files)


def _minor_key(minor: str) -> tuple[int, ...]:
    return tuple(int(part) for part in minor.split("."))


def _series_path(minor: str) -> Path:
    return PATCHES / f"torch-{minor}.series"


def _supported_text() -> str:
    return ", ".join(f"{v}.x" for v in SUPPORTED)


def newest_minor() -> str:
    """The newest supported minor whose series is in this checkout."""
    present = [minor for minor in SUPPORTED if _series_path(minor).is_file()]
    if not present:
        raise OverlayError(f"no series for any of {_supported_text()} in {PATCHES}")
    return max(present, key=_minor_key)


def read_patch(name: str) -> Patch:
    path = SERIES / name
    if not path.is_file():
        raise OverlayError(f"patches/series/{name} is not in this checkout")
    text = path.read_text()
    return Patch(name, text, parse_diff(text.split("\n---\n", 1)[-1]))


def series_names(minor: str) -> list[str]:
    """The patch files of MINOR's series, in the order they apply."""
    path = _series_path(minor)
    if not path.is_file():
        raise OverlayError(f"{path.relative_to(REPO)} is not in this checkout")
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def read_series(minor: str) -> list[Patch]:
    return [read_patch(name) for name in series_names(minor)]


def _series_sha(patches: list[Patch]) -> str:
    return _sha("".join(f"{p.name}\n{p.text}" for p in patches).encode())


def apply_series(
    texts: dict[str, str], patches: list[Patch]
) -> tuple[dict[str, str], list[str]]:
    """TEXTS (upstream files by path) with PATCHES applied in order, and the problems:
    which patch, which file, which hunk, where. A file a patch failed on is left as the
    patches before it made it; later patches do not touch it."""
    out = dict(texts)
    problems: list[str] = []
    failed: dict[str, str] = {}  # path -> the patch that failed on it
    for patch in patches:
        for fp in patch.files:
            if fp.path in failed:
                problems.append(
                    f"{patch.label}: {fp.path}: not tried, "
                    f"{failed[fp.path]} failed on it"
                )
            elif fp.path not in out:
                problems.append(f"{patch.label}: {fp.path}: not in this torch")
                failed[fp.path] = patch.label
            else:
                try:
                    out[fp.path] = patch_text(out[fp.path], fp)
                except OverlayError as e:
                    problems += [
                        f"{patch.label}: {line}" for line in str(e).splitlines()
                    ]
                    failed[fp.path] = patch.label
    return out, problems


def _paths(patches: list[Patch]) -> list[str]:
    return sorted({fp.path for patch in patches for fp in patch.files})


def _hunk_key(path: str, hunk: Hunk) -> tuple:
    return (path, tuple(hunk.old), tuple(hunk.new))


def _patch_name(number: str, slug: str, minors: tuple[str, ...], every: bool) -> str:
    if every:
        return f"{number}-{slug}.patch"
    return f"{number}-{slug}.torch-{'+'.join(minors)}.patch"


def _part_header(
    message: str, fallback: str, minors: tuple[str, ...], main: str
) -> str:
    """The short header of a part that does not carry the message (MAIN does)."""
    subject = next((ln for ln in message.splitlines() if ln.startswith("Subject:")), "")
    subject = subject.removeprefix("Subject:").strip().removeprefix("[PATCH]").strip()
    which = "+".join(minors)
    sentence = textwrap.fill(
        f"These are the hunks of the patch whose upstream text only torch {which} has; "
        f"its message is in {main}.",
        width=88,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return f"Subject: [PATCH] {subject or fallback} (torch {which} part)\n\n{sentence}"


def write_concern(
    number: str, slug: str, message: str, hunks_by_minor: dict[str, list[FilePatch]]
) -> dict[str, list[str]]:
    """Write one concern of the series (one patch, as each minor needs it): every hunk
    once, in the file of the minors whose text it is. Hunks that every minor shares go
    to NNNN-SLUG.patch; the others (upstream's text differs there) to
    NNNN-SLUG.torch-<minors>.patch. The part shared by the most minors carries MESSAGE;
    the others a short header whose Message-In trailer names that part (a reviewer
    reads the message once). Returns each minor's files, in order; the callers put them
    in the series files."""
    minors = sorted(hunks_by_minor, key=_minor_key)
    owners: dict[tuple, list[str]] = {}
    found: dict[tuple, tuple[str, int, Hunk]] = {}  # key -> (path, order, hunk)
    for minor in minors:
        order = 0
        for fp in hunks_by_minor[minor]:
            for hunk in fp.hunks:
                key = _hunk_key(fp.path, hunk)
                owners.setdefault(key, []).append(minor)
                found[key] = (fp.path, order, hunk)  # the newest minor's wins
                order += 1
    groups: dict[tuple[str, ...], list[tuple]] = {}
    for key, who in owners.items():
        groups.setdefault(tuple(who), []).append(key)
    for old in SERIES.glob(f"{number}-*.patch"):
        old.unlink()
    names: dict[str, list[str]] = {minor: [] for minor in minors}
    ordered = sorted(groups, key=lambda who: (-len(who), [_minor_key(m) for m in who]))
    every = {
        who: _patch_name(number, slug, who, len(who) == len(minors)) for who in ordered
    }
    main = every[ordered[0]] if ordered else ""
    for who in ordered:
        name = every[who]
        diff = ""
        # In the order of the file: a minor's hunks read back from its parts come part
        # by part, not in the file's order. A group's hunks all hold the numbers of
        # its newest minor, so their positions compare.
        keys = sorted(
            groups[who],
            key=lambda key: (found[key][0], found[key][2].old_start, found[key][1]),
        )
        for path in dict.fromkeys(found[key][0] for key in keys):
            diff += f"--- a/{path}\n+++ b/{path}\n"
            diff += "".join(found[key][2].text for key in keys if found[key][0] == path)
        # Where the minors' upstream texts differ, the patch is in several parts.
        trailer = f"{_MINORS_TRAILER} {' '.join(who)}"
        trailer += "".join(
            f"\n{_PARTS_TRAILER} {n}" for n in every.values() if n != name
        )
        if name == main:
            head = message.rstrip()
        else:
            head = _part_header(message, f"{number}-{slug}", who, main)
            trailer += f"\n{_MESSAGE_TRAILER} {main}"
        (SERIES / name).write_text(f"{head}\n\n{trailer}\n---\n{diff}")
        for minor in who:
            names[minor].append(name)
    return names


def write_series_file(minor: str, names: list[str]) -> None:
    head = (
        f"# torch {minor}: the patches of patches/series/ that apply to it, in order "
        "(tools/overlay.py)\n"
    )
    _series_path(minor).write_text(head + "".join(f"{name}\n" for name in names))


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

    def not_own_series(self) -> str | None:
        """Why this torch has no series of its own here (None: it has)."""
        if self.minor not in SUPPORTED:
            supported = _supported_text()
            return f"torch {self.version} is not supported (supported: {supported})"
        if not _series_path(self.minor).is_file():
            return (
                f"torch {self.minor} is supported, but "
                f"patches/torch-{self.minor}.series "
                "is not in this checkout"
            )
        return None


def _torch_dir_of(python: str) -> Path | None:
    # Not from the current folder (`-c` puts it first): this repository's torch/
    # would do.
    probe = (
        "import sys; sys.path = [p for p in sys.path if p]; "
        "import importlib.util as u; "
        "s = u.find_spec('torch'); print(s.submodule_search_locations[0] if s else '')"
    )
    found = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True
    ).stdout.strip()
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
    match = re.search(
        r"^__version__\s*=\s*['\"]([^'\"]+)", version_file.read_text(), re.MULTILINE
    )
    if not match:
        raise OverlayError(f"cannot read the torch version from {version_file}")
    return Install(root, match.group(1))


def python_of(torch_dir: Path) -> str | None:
    """The Python whose site-packages holds TORCH_DIR (a venv's or a system's
    <prefix>/lib/pythonX.Y/site-packages), confirmed by asking it where its torch is."""
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


def _upstream_texts(install: Install, manifest: dict | None, paths: list[str]) -> dict:
    """The upstream files PATHS as they were before the overlay patched them, if it did
    (a path missing from this torch is left out)."""
    texts = {}
    for rel in paths:
        source = _upstream(install, manifest, rel)
        if source.is_file():
            texts[rel] = source.read_text()
    return texts


def _series_minor(install: Install, force: bool) -> str:
    """The minor whose series ``apply`` uses: the install's own, or with ``force`` the
    newest where the install has none."""
    reason = install.not_own_series()
    if reason and not force:
        raise OverlayError(
            f"{reason}; nothing applied to {install.torch_dir}. Run `overlay.py check` "
            f"to see whether the newest series (patches/torch-{newest_minor()}.series) "
            "applies and "
            "the upstream contracts hold, then `overlay.py apply --force` to apply it"
        )
    if not reason:
        return install.minor
    minor = newest_minor()
    print(
        f"overlay: warning: {reason}; --force: applying "
        f"patches/torch-{minor}.series, "
        f"made for torch {minor}",
        file=sys.stderr,
    )
    return minor


def apply(install: Install, force: bool = False) -> str:
    minor = _series_minor(install, force)
    patches = read_series(minor)
    links = our_files()
    manifest = install.read_manifest()
    if (
        manifest is not None
        and manifest.get("series") == minor
        and manifest.get("series_sha") == _series_sha(patches)
        # Linked to this checkout: applied from another (an A/B of two commits on one
        # python), the files are linked to this one.
        and manifest.get("repo") == str(REPO)
        and manifest["links"] == links
        and not _drift(install, manifest)
    ):
        return f"already applied to torch {install.version} at {install.torch_dir}"
    # Check everything before touching anything (an older overlay included).
    paths = _paths(patches)
    upstream = _upstream_texts(install, manifest, paths)
    patched, problems = apply_series(upstream, patches)
    if problems:
        raise OverlayError(
            f"patches/torch-{minor}.series does not apply to torch {install.version} "
            f"at "
            f"{install.torch_dir} (its files differ from those the patches were made "
            "against); nothing changed:\n  " + "\n  ".join(problems)
        )
    clashes = _clashes(install, links)
    if clashes:
        raise OverlayError(
            f"{', '.join(map(str, clashes))}: in the installed torch and not ours; "
            f"refusing "
            "to replace upstream files"
        )
    if manifest is not None:
        remove(install)
    files = _write_patched(install, patched)
    made = _link_ours(install, links)
    install.manifest.write_text(
        json.dumps(
            {
                "version": install.version,
                "repo": str(REPO),
                "series": minor,
                "series_sha": _series_sha(patches),
                "patches": {p.name: _sha(p.text.encode()) for p in patches},
                "files": files,
                "links": links,
                "made_dirs": made,
            },
            indent=2,
        )
    )
    return (
        f"applied patches/torch-{minor}.series ({len(patches)} patches) to torch "
        f"{install.version} at {install.torch_dir}: patched {len(files)} upstream "
        f"files, "
        f"linked {len(links)} new files"
    )


def _write_patched(install: Install, patched: dict[str, str]) -> dict[str, dict]:
    """Each upstream file replaced by its PATCHED text, its pristine bytes kept in the
    overlay's state first; both hashes by path, for the manifest."""
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
    return files


def _link_ours(install: Install, links: list[str]) -> list[str]:
    """Our new files linked into the install; the folders made for them (none in a real
    torch, which has them all), which go with `remove`."""
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
    return made


def _upstream(install: Install, manifest: dict | None, rel: str) -> Path:
    """The upstream file REL as it was before the overlay patched it, if it did."""
    if manifest is not None and rel in manifest["files"]:
        return install.state_dir / "pristine" / rel
    return install.site / rel


def _applied(install: Install, manifest: dict) -> str:
    """What the manifest says was applied. Manifests written before the series name the
    single diff they applied."""
    if "series" in manifest:
        return f"patches/torch-{manifest['series']}.series"
    return f"patches/torch-{manifest.get('diff', install.minor)}.diff"


def remove(install: Install) -> str:
    manifest = install.read_manifest()
    if manifest is None:
        return f"not applied to torch {install.version} at {install.torch_dir}"
    pristine_root = install.state_dir / "pristine"
    for rel, shas in manifest["files"].items():
        backup = (pristine_root / rel).read_bytes()
        if _sha(backup) != shas["pristine"]:
            raise OverlayError(
                f"the saved pristine copy of {rel} is damaged; not restoring"
            )
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
        f"removed {_applied(install, manifest)} from torch {install.version} at "
        f"{install.torch_dir}; upstream files restored"
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


def _stale(manifest: dict) -> list[str]:
    """How the repository's series differs from the one applied."""
    if "series" not in manifest:
        return ["applied from a single diff, before the series: run apply again"]
    applied = manifest["patches"]
    try:
        names = series_names(manifest["series"])
    except OverlayError as e:
        return [str(e)]
    lines = []
    for name in names:
        if name not in applied:
            lines.append(f"{name} is in the series now, not applied")
        elif not (SERIES / name).is_file():
            lines.append(f"{name} is not in this checkout")
        elif _sha((SERIES / name).read_bytes()) != applied[name]:
            lines.append(f"{name} changed since it was applied")
    lines += [
        f"{name} was applied, no longer in the series"
        for name in applied
        if name not in names
    ]
    return [f"{line}; run apply again" for line in lines]


def status(install: Install) -> str:
    head = f"torch {install.version} at {install.torch_dir}"
    reason = install.not_own_series()
    manifest = install.read_manifest()
    if manifest is None:
        if reason:
            return (
                f"{head}: {reason}; `overlay.py check` says whether the newest series "
                "applies"
            )
        return f"{head}: overlay not applied"
    lines = [
        f"{head}: overlay applied from {manifest['repo']}, "
        f"{_applied(install, manifest)}"
    ]
    lines += [f"  FORCED  {reason}"] if reason else []
    lines += [
        f"  applied patches/series/{name}" for name in manifest.get("patches", {})
    ]
    lines += [f"  patched {rel}" for rel in manifest["files"]]
    lines += [f"  linked  {rel}" for rel in manifest["links"]]
    lines += [f"  DRIFT   {p}" for p in _drift(install, manifest)]
    lines += [f"  STALE   {p}" for p in _stale(manifest)]
    return "\n".join(lines)


def check(install: Install, python: str | None) -> tuple[str, bool]:
    """Where each hunk of each patch would apply, and whether the upstream contracts
    hold; the report and whether all is well. Reads only."""
    reason = install.not_own_series()
    minor = newest_minor() if reason else install.minor
    patches = read_series(minor)
    manifest = install.read_manifest()
    lines = [
        f"torch {install.version} at {install.torch_dir}",
        f"python: {python or 'none found whose site-packages holds this torch'}",
    ]
    if reason:
        lines.append(
            f"{reason}; checking the newest series, patches/torch-{minor}.series"
        )
    else:
        lines.append(f"checking its own series, patches/torch-{minor}.series")
    if manifest is not None:
        # `apply` would patch the pristine files again, not the patched ones.
        lines.append("the overlay is applied: checking the pristine copies it keeps")
    texts = _upstream_texts(install, manifest, _paths(patches))
    placed, failing = _placements_report(patches, texts)
    lines += placed
    links = our_files()
    clashes = _clashes(install, links)
    lines.append(
        f"new files: {len(links)} to link, {len(clashes)} clash with upstream files"
    )
    lines += [f"  CLASH   {path}" for path in clashes]
    total = sum(p.n_hunks for p in patches)
    lines.append(f"hunks: {total - failing} of {total} apply ({len(patches)} patches)")
    contracts, contracts_hold = _contracts_report(install, python)
    lines += contracts
    ok = failing == 0 and not clashes and contracts_hold
    lines.append("check: OK" if ok else "check: FAILED")
    return "\n".join(lines), ok


def _placements_report(
    patches: list[Patch], texts: dict[str, str]
) -> tuple[list[str], int]:
    """Where each hunk of PATCHES would apply to TEXTS (upstream files by path, patched
    along the way), and how many hunks do not."""
    lines: list[str] = []
    failing = 0
    broken: set[str] = set()  # files a patch failed on: later patches are not tried
    for patch in patches:
        lines.append(patch.label)
        for fp in patch.files:
            lines.append(f"  {fp.path}")
            if fp.path not in texts:
                lines.append(
                    f"    MISSING from this torch: none of its {len(fp.hunks)} hunks "
                    "applies"
                )
                failing += len(fp.hunks)
                continue
            if fp.path in broken:
                lines.append("    NOT TRIED: an earlier patch failed on this file")
                failing += len(fp.hunks)
                continue
            file_lines = texts[fp.path].splitlines(keepends=True)
            placements = place_hunks(file_lines, fp)
            lines += [f"    {p.report()}" for p in placements]
            bad = sum(not p.applies for p in placements)
            failing += bad
            if bad:
                broken.add(fp.path)
            else:
                texts[fp.path] = splice(file_lines, placements)
    return lines, failing


def _contracts_report(install: Install, python: str | None) -> tuple[list[str], bool]:
    """The upstream contracts' script run with PYTHON: its report, and whether they
    hold (true where they cannot be checked, which the report says)."""
    if not (REPO / CONTRACTS).is_file():
        return [f"contracts not checked: {CONTRACTS} is not in this checkout"], True
    if python is None:
        return [
            f"contracts not checked: no Python found whose site-packages holds "
            f"{install.torch_dir}; pass --python"
        ], True
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO / "test" / "inductor"), env.get("PYTHONPATH")])
    )
    run = subprocess.run(
        [python, str(CONTRACTS)], cwd=REPO, env=env, capture_output=True, text=True
    )
    lines = [f"contracts ({python} {CONTRACTS}):"]
    lines += [f"  {line}" for line in (run.stdout + run.stderr).splitlines()]
    if run.returncode not in (0, 1):
        lines.append(f"  the contract script itself failed (exit {run.returncode})")
    return lines, run.returncode == 0


# -- developers: editing a patch of the series ---------------------------------------


def _editing_series(minor: str) -> list[Patch]:
    """The series `edit` and `refresh` work with for MINOR: its own patches and, for
    each patch number of the newest series it has none of yet (a minor being
    ported), the newest's."""
    own = read_series(minor) if _series_path(minor).is_file() else []
    numbers = {p.number for p in own}
    newest = [p for p in read_series(newest_minor()) if p.number not in numbers]
    return sorted(
        own + newest, key=lambda p: p.number
    )  # stable: a number's files in order


def _pristine_texts(pristine_root: Path, patches: list[Patch]) -> dict[str, str]:
    paths = [rel for rel in _paths(patches) if (pristine_root / rel).is_file()]
    return {rel: (pristine_root / rel).read_text() for rel in paths}


def edit(
    minor: str, pristine_root: Path, work_root: Path, upto: str | None = None
) -> str:
    """Write the upstream files under WORK_ROOT with MINOR's series applied (through
    patch number UPTO, if given), for editing by hand. A hunk that does not apply is
    left in <file>.rej beside its file, to port by hand; later patches of that file
    are not tried."""
    patches = [p for p in _editing_series(minor) if upto is None or p.number <= upto]
    texts = _pristine_texts(pristine_root, patches)
    rejected: list[str] = []
    rejects: dict[str, str] = {}
    broken: set[str] = set()
    for patch in patches:
        for fp in patch.files:
            if fp.path not in texts or fp.path in broken:
                continue
            lines = texts[fp.path].splitlines(keepends=True)
            placements = place_hunks(lines, fp)
            texts[fp.path] = splice(lines, placements)
            failed = [p for p in placements if not p.applies]
            if failed:
                broken.add(fp.path)
                rej = work_root / f"{fp.path}.rej"
                rejects[fp.path] = rejects.get(fp.path, "") + "".join(
                    f"# {patch.label}\n{p.hunk.text}" for p in failed
                )
                rejected += [
                    f"  {patch.label}: {fp.path}: {p.problem()}, left in {rej}"
                    for p in failed
                ]
    for rel, text in texts.items():
        dst = work_root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)
        rej = dst.with_name(dst.name + ".rej")
        rej.unlink(missing_ok=True)  # an earlier edit's rejects are not this one's
        if rel in rejects:
            rej.write_text(rejects[rel])
    through = f" through {upto}" if upto else ""
    head = (
        f"{len(texts)} files with the patches of torch {minor}{through} written under "
        f"{work_root}"
    )
    if not rejected:
        return head
    return "\n".join(
        [f"{head}; hunks that did not apply, to port by hand before `refresh`:"]
        + rejected
    )


def refresh(minor: str, pristine_root: Path, work_root: Path, number: str) -> str:
    """Make patch NUMBER of MINOR's series what WORK_ROOT holds: its diff against the
    pristine files with the patches before NUMBER applied (a work dir that `edit
    --upto NUMBER` wrote, then edited). The patch keeps its message; its hunks are
    shared again with the other minors whose text they are (write_concern), and the
    series files name the result. MINOR gets a series file if it has none (a port)."""
    patches = _editing_series(minor)
    own = [p for p in patches if p.number == number]
    if not own:
        raise OverlayError(
            f"no patch {number} in the series of torch {minor} or the newest"
        )
    before, problems = apply_series(
        _pristine_texts(pristine_root, patches),
        [p for p in patches if p.number < number],
    )
    if problems:
        raise OverlayError(
            f"the patches before {number} do not apply to {pristine_root}; "
            "refresh them "
            "first:\n  " + "\n  ".join(problems)
        )
    diff = ""
    for path in sorted(str(p.relative_to(work_root)) for p in work_root.rglob("*.py")):
        base = pristine_root / path
        with tempfile.NamedTemporaryFile("w", suffix=".py") as tmp:
            tmp.write(before.get(path) or (base.read_text() if base.is_file() else ""))
            tmp.flush()
            diff += make_diff(path, Path(tmp.name), work_root / path)
    slug, message = own[0].slug, own[0].message
    hunks_by_minor = {minor: parse_diff(diff)}
    # Every minor with a series, listed or not yet (a port): none loses its part.
    for path in PATCHES.glob("torch-*.series"):
        other = path.name[len("torch-") : -len(".series")]
        if other != minor:
            names = series_names(other)
            mine = [read_patch(n) for n in names if n.startswith(f"{number}-")]
            if mine:
                hunks_by_minor[other] = [fp for p in mine for fp in p.files]
    written = write_concern(number, slug, message, hunks_by_minor)
    for other, names in written.items():
        current = series_names(other) if _series_path(other).is_file() else []
        kept = [n for n in current if not n.startswith(f"{number}-")]
        write_series_file(other, sorted(kept + names, key=lambda n: n[:4]))
    files = sorted({n for names in written.values() for n in names})
    return f"patch {number} of torch {minor} refreshed: " + ", ".join(
        f"patches/series/{n}" for n in files
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--python", help="the Python whose torch to patch (default: this one)"
    )
    parser.add_argument("--torch-dir", help="the torch package directory to patch")
    parser.add_argument(
        "--force",
        action="store_true",
        help="apply: the newest series to an unsupported torch",
    )
    parser.add_argument(
        "--upto", help="edit: apply the patches through this number only"
    )
    parser.add_argument(
        "command", choices=["apply", "remove", "status", "check", "edit", "refresh"]
    )
    parser.add_argument("args", nargs="*")
    opts = parser.parse_args(argv)
    if opts.force and opts.command != "apply":
        parser.error("--force goes with apply only")
    if opts.upto and opts.command != "edit":
        parser.error("--upto goes with edit only")
    expected = {"edit": 3, "refresh": 4}.get(opts.command, 0)
    if len(opts.args) != expected:
        parser.error(f"{opts.command} takes {expected or 'no'} arguments (see --help)")
    try:
        if opts.command == "edit":
            minor, pristine, work = opts.args
            print(edit(minor, Path(pristine), Path(work), opts.upto))
            return 0
        if opts.command == "refresh":
            minor, pristine, work, number = opts.args
            print(refresh(minor, Path(pristine), Path(work), number))
            return 0
        install = locate(opts.python, opts.torch_dir)
        if opts.command == "check":
            if opts.python:
                python = opts.python
            else:
                python = (
                    python_of(install.torch_dir) if opts.torch_dir else sys.executable
                )
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
