"""The documentation site: it builds with `mkdocs build --strict`, every internal link and image resolves,
and the home page renders in a headless browser.

The site is built once per session into a temporary folder (a few seconds). The browser check needs Chromium
(`.ci/run` installs it) and skips with the reason where it is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import CHROMIUM, HANG_GUARD_S, NO_CHROMIUM, chromium

REPO = Path(__file__).resolve().parents[1]
SITE_NAME = "bigtune"

pytest.importorskip("mkdocs", reason="the docs packages are not installed: pip install -e '.[docs]'")
pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
pytest.importorskip("mkdocstrings", reason="mkdocstrings is not installed: pip install -e '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (out / "index.html").is_file()
    return out


class _Collector(HTMLParser):
    """Collects every id in a page and every (tag, attribute, url) that points somewhere."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for attr in ("href", "src"):
            if a.get(attr) is not None and tag in ("a", "img", "link", "script", "source", "iframe"):
                self.refs.append((tag, attr, a[attr]))


def _parse(page: Path) -> _Collector:
    c = _Collector()
    c.feed(page.read_text(encoding="utf-8"))
    return c


def test_site_builds_with_generated_reference(site):
    recipe = (site / "reference" / "recipe.html").read_text(encoding="utf-8")
    cli = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    # generated at build time from the code: markers replaced, real keys and flags present
    for page in site.rglob("*.html"):
        assert "<!-- generated:" not in page.read_text(encoding="utf-8"), f"unreplaced marker in {page}"
    assert "train.micro_batch_size" in recipe and "optim.in_backward" in recipe
    for command in ("train", "plan", "sweep", "report", "caption", "predict", "launch"):
        assert f'id="bigtune-{command}"' in cli, f"bigtune {command} missing from the CLI reference"
    assert "--alternatives" in cli and "--plan-only" in cli
    api = (site / "reference" / "api.html").read_text(encoding="utf-8")
    assert "load_recipe" in api and "RecipeError" in api
    http_api = (site / "reference" / "http-api.html").read_text(encoding="utf-8")  # from the service's OpenAPI schema
    for route in ("POST /v1/jobs", "GET /v1/jobs/{job_id}/metrics", "POST /v1/jobs/{job_id}/cancel"):
        assert route in http_api, f"{route} missing from the HTTP API reference"
    assert 'id="jobview"' in http_api and "queue_position" in http_api


def test_internal_links_and_images_resolve(site):
    pages = {p: _parse(p) for p in site.rglob("*.html")}
    problems = []
    checked = 0
    for page, parsed in pages.items():
        for tag, attr, url in parsed.refs:
            parts = urlsplit(url)
            if parts.scheme or parts.netloc or url.startswith(("mailto:", "javascript:", "data:")):
                continue  # external: not part of the site
            rel = page.relative_to(site)
            if not parts.path:  # "#anchor" on the same page
                target = page
            else:
                # root-relative URLs (the 404 page uses them) are relative to the site root
                base = site if parts.path.startswith("/") else page.parent
                target = (base / unquote(parts.path).lstrip("/")).resolve()
                if target.is_dir():
                    target = target / "index.html"
                try:
                    target.relative_to(site.resolve())
                except ValueError:
                    problems.append(f"{rel}: {tag} {attr}={url!r} leaves the site")
                    continue
                if not target.is_file():
                    problems.append(f"{rel}: {tag} {attr}={url!r} -> missing {target.relative_to(site.resolve())}")
                    continue
            checked += 1
            if parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{rel}: {tag} {attr}={url!r}: no id {parts.fragment!r} in {target.name}")
    assert checked > 100, f"only {checked} internal links checked; is the site empty?"
    assert not problems, "broken internal links or images:\n" + "\n".join(problems)
    # the pictures the pages show are in the site
    imgs = [(p, u) for p, parsed in pages.items() for t, _, u in parsed.refs if t == "img"]
    assert any("lab-single-tiny-memory.png" in u for _, u in imgs)


def test_home_page_renders_in_chromium(site, tmp_path):
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    url = (site / "index.html").as_uri()
    dom = chromium("--virtual-time-budget=3000", "--dump-dom", url, timeout=60)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    assert f"<title>{SITE_NAME}</title>" in html or f"{SITE_NAME}</title>" in html, html[:1000]
    assert 'class="md-nav' in html, "the navigation is not in the rendered page"
    for section in ("Tutorials", "How-to guides", "Reference", "Explanation"):
        assert section in html, f"nav section {section!r} missing from the rendered home page"
    assert "lab-single-tiny-memory.png" in html

    png = tmp_path / "home.png"
    shot = chromium(
        "--window-size=1280,900",
        "--hide-scrollbars",
        "--virtual-time-budget=3000",
        f"--screenshot={png}",
        url,
        timeout=60,
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
    assert len(data) > 20_000, f"the screenshot is only {len(data)} bytes: the page probably rendered blank"
