"""The documentation site: ``mkdocs build --strict`` succeeds (no broken link, no missing page, no
docstring the API reference cannot render), and the built site renders in a real browser.

The browser test loads the home page and three content pages in headless Chromium (Debian's
``chromium`` package; ``.ci/run`` installs it), served over HTTP from the built site, at a desktop
and a narrow (phone) width. A script added to a copy of each page reports, after load, whether the
navigation is shown (desktop: the sidebar; narrow: the menu button, and the sidebar once the menu
is opened; transitions are switched off in the checked copy so the
layout is measured, not an animation frame), whether a figure has loaded and is laid out, whether a code block is laid out and
highlighted, and whether the search box exists. Screenshots of each page at each width are kept in
``build/site-screenshots/`` (ignored by git) for a person to look at.
"""
from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "build" / "site-screenshots"
PAGES = {  # page -> what its figure shows (each page has a figure and a code block)
    "index.html": "error_bound_flow.png",
    "formats/index.html": "value_grids.png",
    "dispatch/index.html": "dispatch_layouts.png",
    "error-bounds/index.html": "error_bound_flow.png",
}
WIDTHS = {"desktop": (1280, 900), "narrow": (500, 900)}  # 500: headless Chromium's narrowest window
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--virtual-time-budget=4000"]

CHECK_SCRIPT = """
<style>* { transition: none !important; animation: none !important; }</style>
<script>
window.addEventListener("load", () => setTimeout(() => {
  const shown = el => { if (!el) return false; const r = el.getBoundingClientRect(), s = getComputedStyle(el);
    return r.width > 0 && r.height > 0 && r.right > 0 && r.left < innerWidth
           && s.visibility !== "hidden" && s.display !== "none"; };
  const content = document.querySelector(".md-content");
  const imgs = Array.from(content.querySelectorAll("img"));
  const code = Array.from(content.querySelectorAll("pre code")).find(c => c.querySelector("span"));
  const sidebar = document.querySelector(".md-sidebar--primary");
  const links = sidebar ? sidebar.querySelectorAll("a.md-nav__link").length : 0;
  const result = {width: innerWidth, nav_links: links, sidebar_shown: shown(sidebar),
    menu_button_shown: shown(document.querySelector("label.md-header__button[for='__drawer']")),
    search_box: !!document.querySelector(".md-search__input"),
    imgs: imgs.map(img => ({src: img.getAttribute("src"), loaded: img.complete && img.naturalWidth > 0,
                            shown: shown(img)})),
    code: code ? {shown: shown(code), highlighted: code.querySelectorAll("span").length > 0} : null};
  const drawer = document.getElementById("__drawer");
  if (drawer) drawer.checked = true;          // open the menu (the narrow layout's navigation)
  setTimeout(() => {
    result.sidebar_shown_after_menu = shown(sidebar);
    if (drawer) drawer.checked = false;       // closed again for the screenshot
    const pre = document.createElement("pre"); pre.id = "moeref-check";
    pre.textContent = JSON.stringify(result); document.body.appendChild(pre);
  }, 800);
}, 300));
</script>
"""


def _mkdocs_available() -> bool:
    try:
        import mkdocs  # noqa: F401
        import mkdocstrings  # noqa: F401
        import material  # noqa: F401
    except ImportError:
        return False
    return True


needs_mkdocs = pytest.mark.skipif(not _mkdocs_available(),
                                  reason="the docs extra is not installed (pip install -e '.[docs]')")


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


@needs_mkdocs
def test_site_builds_strict_with_every_page_and_the_api_reference(site):
    for page in ("index.html", "formats/index.html", "nvfp4/index.html", "api/quant/index.html",
                 "api/cli/index.html", "search/search_index.json"):
        assert (site / page).is_file(), page
    api = (site / "api" / "quant" / "index.html").read_text()
    assert 'id="moeref.quant.quantize"' in api                    # a function's own heading
    assert 'class="doc doc-heading"' in api                       # rendered by mkdocstrings
    # bare doctest examples of docstrings are code blocks, not nested block quotes
    formats_api = (site / "api" / "formats" / "index.html").read_text()
    assert "<blockquote>" not in formats_api
    assert '<span class="gp">&gt;&gt;&gt; </span>' in formats_api      # a highlighted prompt
    for fig in set(PAGES.values()) | {"annotated_report.png", "swizzle_128x4.png"}:
        assert (site / "figures" / fig).stat().st_size > 10_000, fig


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass


@needs_mkdocs
@pytest.mark.skipif(_chromium() is None,
                    reason="chromium is not installed (apt-get install -y chromium; .ci/run does it)")
@pytest.mark.parametrize("width", sorted(WIDTHS))
@pytest.mark.parametrize("page", sorted(PAGES))
def test_pages_render_in_a_browser(site, server, tmp_path, page, width):
    w, h = WIDTHS[width]
    check_page = page.replace(".html", ".check.html")
    (site / check_page).write_text((site / page).read_text().replace("</body>", CHECK_SCRIPT + "</body>"))
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / f"{page.replace('/index.html', '').replace('.html', '')}-{width}.png"
    cmd = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
           f"--window-size={w},{h}", f"--screenshot={shot}", "--dump-dom", f"{server}/{check_page}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    m = re.search(r'<pre id="moeref-check">(.*?)</pre>', r.stdout, re.S)
    assert m, f"the check script did not report (rc {r.returncode}): {r.stderr[-2000:]}"
    got = json.loads(html.unescape(m.group(1)))
    assert got["width"] == w
    # navigation: every page of the nav is linked; desktop shows the sidebar, narrow the menu button
    assert got["nav_links"] >= 20
    if width == "desktop":
        assert got["sidebar_shown"] and not got["menu_button_shown"]
    else:
        assert got["menu_button_shown"] and not got["sidebar_shown"]
        assert got["sidebar_shown_after_menu"]           # the menu opens the navigation
    assert got["search_box"]
    # a figure: the page's image loaded and laid out
    img = [i for i in got["imgs"] if i["src"].endswith(PAGES[page])]
    assert img and img[0]["loaded"] and img[0]["shown"], got["imgs"]
    # a code block: laid out and syntax-highlighted
    assert got["code"] and got["code"]["shown"] and got["code"]["highlighted"]
    assert shot.is_file() and shot.stat().st_size > 20_000   # kept for a person to look at
