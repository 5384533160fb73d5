"""The documentation site: built with ``mkdocs build --strict`` (broken links, missing references and unknown pages
fail), its generated pages current with the code, and its pages looked at in a real browser (headless Chromium from
Debian's packages; ``scripts/setup_env.sh`` installs it where it may, ``FSDP_PLUS_SKIP_BROWSER=1`` skips on request).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import REPO, failure_excerpt, subprocess_env

sys.path.insert(0, str(REPO / "scripts"))
import render_docs

BROWSERS = ("chromium-headless-shell", "chromium")
MATERIAL_INDIGO = (0x40 / 255, 0x51 / 255, 0xB5 / 255)
"""The Material theme's default primary colour (its header bar): present only when the theme's CSS loaded."""


def _mkdocs_build(root: Path, out: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the project at ``root`` into ``out``, as scripts/test.sh runs it."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=root,
                          env=subprocess_env() | {"NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = _mkdocs_build(REPO, out)
    assert proc.returncode == 0, failure_excerpt(proc.stdout + proc.stderr)
    return out


def test_the_site_builds_strict_with_the_guide_the_generated_reference_and_the_measured_pages(site):
    pages = {p.relative_to(site).parent.as_posix() for p in site.rglob("index.html")}
    assert {"getting-started", "lora", "hydra-app", "troubleshooting", "migrating"} <= pages  # the guide
    assert {"reference/strategy", "reference/options", "reference/plan", "reference/cli", "reference/hydra"} <= pages
    assert {"measured/performance", "measured/loading", "measured/autoplan", "measured/examples"} <= pages
    strategy = (site / "reference" / "strategy" / "index.html").read_text()
    assert 'class="doc-signature' in strategy and "sharding_plan" in strategy  # generated from the code
    assert ":class:" not in strategy and ":mod:" not in strategy  # Sphinx roles shown as code (the hook)
    import html
    import re

    signature = html.unescape(re.sub(r"<[^>]+>", "", strategy))
    assert re.search(r'sharding_strategy: str\s*\|\s*ShardingStrategy = "FULL_SHARD"', signature)  # the real default
    assert "_UNSET" not in signature  # not a sentinel of ours
    options = (site / "reference" / "options" / "index.html").read_text()
    assert "<code>reshard_root_after_forward</code>" in options  # the generated options table
    changelog = (site / "changelog" / "index.html").read_text()
    first_heading = next(line for line in (REPO / "CHANGELOG.md").read_text().splitlines() if line.startswith("## "))
    assert first_heading.removeprefix("## ").split(" ")[0].strip("[]") in changelog
    index = (site / "index.html").read_text()
    assert "Cannot flatten integer dtype tensors" in index  # the README's comparison table, included


def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The strict build can fail: the same site with one link to a page that does not exist."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md"):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(REPO / "scripts", copy / "scripts")
    (copy / "lightning_fsdp_plus").symlink_to(REPO / "lightning_fsdp_plus")
    page = copy / "docs" / "troubleshooting.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    proc = _mkdocs_build(copy, tmp_path / "out")
    assert proc.returncode != 0
    assert "no-such-page.md" in proc.stdout + proc.stderr and "strict mode" in proc.stdout + proc.stderr


def test_the_generated_pages_are_current_and_a_stale_one_is_caught(tmp_path):
    assert render_docs.stale_pages() == [], "run python scripts/render_docs.py"
    copy = tmp_path / "docs"
    shutil.copytree(REPO / "docs", copy)
    options = copy / "reference" / "options.md"
    options.write_text(options.read_text().replace("| `lora_only` |", "| `lora_onl` |"))
    assert render_docs.stale_pages(docs=copy) == ["docs/reference/options.md"]
    assert render_docs.stale_pages(docs=copy, write=True) == ["docs/reference/options.md"]
    assert render_docs.stale_pages(docs=copy) == []  # rewritten from the code


def _browser() -> str:
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        if os.environ.get("FSDP_PLUS_SKIP_BROWSER") == "1":
            pytest.skip("FSDP_PLUS_SKIP_BROWSER=1: no browser check asked for")
        pytest.fail("no headless Chromium: `apt-get install chromium-headless-shell` (scripts/setup_env.sh does as"
                    " root), or FSDP_PLUS_SKIP_BROWSER=1 to skip the browser check")  # fmt: skip
    return found


def _chromium(*args: str) -> subprocess.CompletedProcess:
    command = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("index.html", ["lightning-fsdp-plus", "Where to start", "How it differs from Lightning"]),
        ("reference/strategy/index.html", ["FSDPPlusStrategy", "doc-signature", "sharding_strategy"]),
    ],
)
def test_pages_render_in_a_real_browser(site, tmp_path, page, expected):
    """Chromium loads the page: its DOM after scripts ran has the title, the navigation and the generated content,
    and a screenshot shows the theme's header bar and text (not a blank or unstyled page)."""
    import matplotlib.image
    import numpy as np

    url = (site / page).as_uri()
    dom = _chromium("--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<title>" in dom.stdout and 'class="md-nav' in dom.stdout, dom.stdout[:2000]
    for text in expected:
        assert text in dom.stdout, text
    shot = tmp_path / "page.png"
    taken = _chromium("--window-size=1280,900", f"--screenshot={shot}", url)
    assert taken.returncode == 0 and shot.is_file(), taken.stderr[-2000:]
    image = matplotlib.image.imread(shot)[..., :3]
    assert image.shape[:2] == (900, 1280)
    header = image[5:40, 300:900].reshape(-1, 3).mean(axis=0)
    assert np.allclose(header, MATERIAL_INDIGO, atol=0.08), header  # the theme's CSS applied
    body = image[120:, 280:1000]
    dark = (body.mean(axis=2) < 0.5).mean()
    assert 0.005 < dark < 0.5, dark  # text on a light page: neither blank nor a solid block


def test_names_in_the_first_column_of_a_table_are_never_broken_across_lines(site, tmp_path):
    """In Chromium at a laptop's width, every name in the options table's first column lays out on one line (the
    theme let inline code break anywhere: "sharding_st / rategy")."""
    page = site / "reference" / "options" / "index.html"
    probe = """<script>
      const names = [...document.querySelectorAll('.md-typeset table td:first-child code')];
      const broken = names.filter(c => c.getClientRects().length > 1).map(c => c.textContent);
      document.body.setAttribute('data-names', String(names.length));
      document.body.setAttribute('data-broken', broken.join(','));
    </script></body>"""
    probed = page.with_name("probed.html")
    probed.write_text(page.read_text().replace("</body>", probe, 1))
    dom = _chromium("--window-size=1024,800", "--virtual-time-budget=5000", "--dump-dom", probed.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    import re

    names = re.search(r'data-names="(\d+)"', dom.stdout)
    broken = re.search(r'data-broken="([^"]*)"', dom.stdout)
    assert names and int(names.group(1)) >= 30, dom.stdout[-2000:]  # the options table's rows were looked at
    assert broken and broken.group(1) == "", broken.group(1) if broken else dom.stdout[-2000:]
