"""docs/ stays a reference for users and reviewers: short, and free of what goes stale.

History (dates, commits, measurements) belongs in benchmarks/results/HISTORY.md; the
docs may link only to files in the repository, and the README's links into docs/ must
find their section. No torch import: these read text files only.
"""

from __future__ import annotations

import re
import tempfile
import unittest
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MAX_DOCS_LINES = 500
# http(s) links the docs may hold; none so far.
ALLOWED_URL_PREFIXES: tuple[str, ...] = ()

# A commit hash: 7-40 hex characters with at least one digit and one letter.
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# [text](target) and ![alt](target); the target ends at whitespace or ")".
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL = re.compile(r"https?://[^\s)>\]]+")


def doc_files() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*") if p.is_file())


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings (outside code fences)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if match is None:
            continue
        text = re.sub(r"[`*_]", "", match.group(1).strip()).lower()
        slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(source: Path, repo: Path = REPO) -> list[str]:
    """The links of ``source`` that name no file of ``repo``, or no heading of it."""
    broken = []
    for target in MARKDOWN_LINK.findall(source.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # a URL: checked on its own
            continue
        path_part, _, anchor = target.partition("#")
        path = (source.parent / path_part).resolve() if path_part else source
        if not path.exists() or repo.resolve() not in (path, *path.parents):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and path.suffix == ".md":
            if anchor not in heading_anchors(path.read_text()):
                broken.append(f"{target} (no such section)")
    return broken


class TestDocs(unittest.TestCase):
    def test_docs_are_at_most_500_lines(self) -> None:
        lines = {
            str(p.relative_to(REPO)): len(p.read_text().splitlines())
            for p in doc_files()
        }
        self.assertLessEqual(sum(lines.values()), MAX_DOCS_LINES, lines)

    def test_docs_hold_no_commit_hash_nor_date(self) -> None:
        for path in doc_files():
            text = path.read_text()
            with self.subTest(path=str(path.relative_to(REPO))):
                self.assertEqual(COMMIT_HASH.findall(text), [])
                self.assertEqual(DATE.findall(text), [])

    def test_docs_link_only_to_files_in_the_repository(self) -> None:
        for path in doc_files():
            with self.subTest(path=str(path.relative_to(REPO))):
                self.assertEqual(broken_links(path), [])
                urls = [
                    url
                    for url in URL.findall(path.read_text())
                    if not url.startswith(ALLOWED_URL_PREFIXES)
                ]
                self.assertEqual(urls, [])

    def test_the_readmes_links_into_the_docs_find_their_section(self) -> None:
        readme = REPO / "README.md"
        into_docs = [
            link
            for link in broken_links(readme)
            if link.startswith(("docs/", "./docs/"))
        ]
        self.assertEqual(into_docs, [])


class TestTheChecksThemselves(unittest.TestCase):
    """Each check fails on what it is there to catch."""

    def test_a_commit_hash_is_found_and_a_word_is_not(self) -> None:
        self.assertEqual(
            COMMIT_HASH.findall("since 9510eb0, see c478299"), ["9510eb0", "c478299"]
        )
        self.assertEqual(COMMIT_HASH.findall("a facade decade 1234567 deadbeef"), [])

    def test_a_date_is_found(self) -> None:
        self.assertEqual(DATE.findall("measured on 2026-11-29."), ["2026-11-29"])

    def test_a_link_outside_the_repository_is_broken(self) -> None:
        with tempfile.TemporaryDirectory() as folder:
            repo = Path(folder) / "repo"
            (repo / "docs").mkdir(parents=True)
            (Path(folder) / "outside.md").write_text("# Outside\n")
            page = repo / "docs" / "page.md"
            page.write_text(
                "# A title\n[ok](page.md#a-title) [outside](../../outside.md) "
                "[missing](nowhere.md) [section](page.md#no-such) ![img](x.png)\n"
            )
            self.assertEqual(
                broken_links(page, repo),
                [
                    "../../outside.md (no such file in the repository)",
                    "nowhere.md (no such file in the repository)",
                    "page.md#no-such (no such section)",
                    "x.png (no such file in the repository)",
                ],
            )

    def test_a_url_is_found(self) -> None:
        self.assertEqual(
            URL.findall("see https://example.com/a)."), ["https://example.com/a"]
        )


if __name__ == "__main__":
    unittest.main()
