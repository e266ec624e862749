"""Every ```python block of the documentation runs (CPU).

Each page (``docs/*.md`` and ``README.md``) is one test: its python blocks run in order in one
namespace of their own, so a later block may use what an earlier one defined. Blocks fenced as
anything else (```text, ```bash, ...) are not run. A failure names the page, the block's index
among the page's python blocks and its first line in the file. A page whose first python block
imports a package that is not installed (an optional dependency, such as transformers for
docs/integration_transformers.md) is skipped, the skip naming the package.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language (first word of the info string), first code line
    (1-based, in the file) and source."""

    language: str
    line: int
    source: str


def code_blocks(text: str) -> list[Block]:
    """All fenced code blocks of a Markdown text, in order.

    A block closes at a line holding only the same fence character, at least as long as the
    opening fence; the opening fence's indentation is removed from the code lines (blocks in
    list items). An unclosed block raises ``ValueError``.
    """
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        words = opening["info"].strip().split()
        language = words[0].lower() if words else ""
        start = index + 1
        end = start
        while end < len(lines):
            stripped = lines[end].strip()
            if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
                break
            end += 1
        else:
            raise ValueError(f"code block opened at line {index + 1} is never closed")
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[start:end]]
        blocks.append(Block(language, start + 1, "\n".join(body) + "\n"))
        index = end + 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    return [b for b in code_blocks(page.read_text(encoding="utf-8")) if b.language == "python"]


def missing_import(block: Block) -> str | None:
    """The first top-level package the block imports (at module level) that is not installed,
    or None."""
    for node in ast.parse(block.source).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            package = name.partition(".")[0]
            if importlib.util.find_spec(package) is None:
                return package
    return None


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _page_id(page)
    blocks = python_blocks(page)
    missing = missing_import(blocks[0]) if blocks else None
    if missing is not None:
        pytest.skip(f"{name} needs {missing}, which is not installed (its first python block "
                    "imports it: an optional dependency)")
    # A fresh module per page: its blocks share it (a real module, so classes and dataclasses
    # defined in a block behave as in a script). Files a block writes land in tmp_path.
    module = types.ModuleType(f"leangraph_docs_{page.stem.replace('-', '_')}")
    module.__file__ = str(page)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    failures = []
    for number, block in enumerate(blocks):
        # Every block runs, even after a failure, so that one report lists every broken block
        # (a later failure may follow from an earlier one, through the shared namespace).
        where = f"{name}, python block {number} (line {block.line})"
        try:
            # Padded so that tracebacks give the line numbers of the page itself.
            code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
            exec(code, module.__dict__)
        except (Exception, SystemExit) as exc:
            details = "".join(traceback.format_exception(exc))
            failures.append(f"{where} failed: {type(exc).__name__}: {exc}\n\n{details}")
    if failures:
        summary = "\n".join(f.partition("\n")[0] for f in failures)
        pytest.fail(f"{len(failures)} of {len(blocks)} python blocks failed:\n{summary}\n\n"
                    + "\n".join(failures), pytrace=False)


# ------------------------------------------------------------------------ the collector itself


def test_code_blocks_parses_languages_indentation_and_longer_fences() -> None:
    text = "\n".join([
        "intro",
        "```python",
        "x = 1",
        "```",
        "```text",
        "not run",
        "```",
        "* item",
        "",
        "  ```python",
        "  y = x + 1",
        "  ```",
        "````bash",
        "```",
        "````",
        "```",
        "plain",
        "```",
    ])
    blocks = code_blocks(text)
    assert [(b.language, b.line, b.source) for b in blocks] == [
        ("python", 3, "x = 1\n"),
        ("text", 6, "not run\n"),
        ("python", 11, "y = x + 1\n"),
        ("bash", 14, "```\n"),
        ("", 17, "plain\n"),
    ]


def test_missing_import_names_the_first_absent_package() -> None:
    def block(source: str) -> Block:
        return Block("python", 1, source)

    assert missing_import(block("import torch\nfrom leangraph import order\n")) is None
    absent = "leangraph_no_such_package"
    assert missing_import(block(f"import os\nfrom {absent}.sub import x\n")) == absent
    assert missing_import(block(f"import json, {absent}\n")) == absent
    # Only module-level imports count: a guarded import inside a function is the block's own.
    assert missing_import(block(f"def f():\n    import {absent}\n")) is None


def test_unclosed_block_is_an_error() -> None:
    with pytest.raises(ValueError, match="line 2 is never closed"):
        code_blocks("text\n```python\nx = 1\n")


def test_every_docs_page_parses_and_is_in_the_index() -> None:
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for page in PAGES:
        code_blocks(page.read_text(encoding="utf-8"))  # raises on an unclosed fence
        if page.parent.name == "docs" and page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"


def test_the_readme_lists_every_docs_page() -> None:
    # The README says its list holds every page (it missed the pipelining integration's).
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [page.name for page in PAGES
               if page.parent.name == "docs" and f"](docs/{page.name})" not in readme]
    assert not missing, f"README.md's documentation list does not link {missing}"
