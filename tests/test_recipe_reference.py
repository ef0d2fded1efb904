"""The recipe reference (docs/reference/recipe.md, `bigtune recipe --docs`): one section per recipe block with
its own table, an index of the blocks, and an anchor per key so `recipe.md#train.max_steps` links to its row.

The blocks expected are read from the schema's types (every `Recipe` field whose type is a dataclass), not
from the generator, so a new block or key shows up here without editing the test.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from html.parser import HTMLParser
from pathlib import Path

import pytest

from bigtune.recipe import Recipe, schema_markdown, schema_rows
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
HEADING = re.compile(r"^## (.+?)(?: \{#([^}]+)\})?$")


def _blocks() -> list[str]:
    hints = typing.get_type_hints(Recipe)
    return [f.name for f in dataclasses.fields(Recipe) if dataclasses.is_dataclass(hints[f.name])]


def _sections(markdown: str) -> dict[str, list[str]]:
    """heading line -> the keys in the table under it (the first backticked word of each row)."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in markdown.splitlines():
        if HEADING.match(line):
            current = line
            sections[current] = []
        elif current and line.startswith("| ") and "`" in line and not line.startswith("| key "):
            sections[current].append(re.search(r"`([^`]+)`", line).group(1))
    return sections


def test_one_section_per_block_holding_exactly_its_keys():
    blocks = _blocks()
    assert {"model", "data", "train", "optim"} <= set(blocks)  # the schema has blocks at all
    all_keys = [row[0] for row in schema_rows()]
    top_level = [k for k in all_keys if "." not in k]
    sections = _sections(schema_markdown())
    expected = [f"## `{b}`" for b in blocks] + ["## Top-level keys"]
    assert list(sections) == expected
    for block in blocks:
        assert sections[f"## `{block}`"] == [k for k in all_keys if k.startswith(block + ".")]
    assert sections["## Top-level keys"] == top_level
    # every key once, in exactly one section
    assert sorted(k for keys in sections.values() for k in keys) == sorted(all_keys)


def test_index_links_every_section_and_terminal_text_has_no_html():
    text = schema_markdown()
    index = text.split("\n## ", 1)[0]
    for block in _blocks():
        assert f"](#{block}) |" in index, f"block {block} missing from the index"
    assert "](#top-level) |" in index
    assert "<a " not in text and "{#" not in text  # the terminal gets plain Markdown


def test_anchor_per_key_and_per_block_for_the_site():
    text = schema_markdown(anchors=True)
    ids = re.findall(r'<a id="([^"]+)"></a>', text)
    assert sorted(ids) == sorted(row[0] for row in schema_rows())
    heading_ids = [m.group(2) for line in text.splitlines() if (m := HEADING.match(line))]
    assert heading_ids == [*_blocks(), "top-level"]
    assert len(set(ids) | set(heading_ids)) == len(ids) + len(heading_ids), "an anchor id is used twice"


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: list[str] = []
        self.self_links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.append(a["id"])
        if tag == "a" and (a.get("href") or "").startswith("#"):
            self.self_links.append(a["href"][1:])


def test_page_rendered_as_mkdocs_renders_it_keeps_every_anchor():
    # The docs hook fills the page's marker; Python-Markdown with the site's extensions (mkdocs.yml) renders
    # it. Every key and block must come out as an id, and every in-page link must land on one.
    markdown = pytest.importorskip("markdown", reason="Python-Markdown is not installed: pip install -e '.[docs]'")
    spec = importlib.util.spec_from_file_location("docs_gen_hook", ROOT / "docs" / "_hooks" / "gen.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (ROOT / "docs" / "reference" / "recipe.md").read_text(encoding="utf-8")
    filled = hook.on_page_markdown(page, page=None, config=None, files=None)
    assert "<!-- generated:" not in filled
    html = markdown.markdown(filled, extensions=["attr_list", "tables", "toc"])
    parsed = _Ids()
    parsed.feed(html)
    ids = set(parsed.ids)
    missing = [row[0] for row in schema_rows() if row[0] not in ids]
    assert not missing, f"keys without an anchor on the page: {missing}"
    assert set(_blocks()) | {"top-level"} <= ids
    assert "train.max_steps" in parsed.self_links
    assert not [link for link in parsed.self_links if link not in ids]
    assert html.count("<table>") == len(_blocks()) + 2  # the index, one per block, the top-level keys


def test_recipe_docs_command_prints_the_sections(tmp_path):
    res = run_cli("recipe", "--docs", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert list(_sections(res.stdout)) == [f"## `{b}`" for b in _blocks()] + ["## Top-level keys"]
