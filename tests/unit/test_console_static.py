"""The console's static files and templates: the vendored files are the ones VENDORED.md pins
(SHA-256), and no template holds inline script, inline style or an event-handler attribute (the
Content-Security-Policy would block them: a page that relied on one would break silently)."""

from __future__ import annotations

import hashlib
import re

import pytest

from broker.console.templates import TEMPLATES, load_templates
from broker.console.web import CONTENT_TYPES, STATIC

PINNED = re.compile(r"^\| `([^`]+)` \| [^|]+ \| ([0-9.]+) \| `([0-9a-f]{64})` \|", re.MULTILINE)
INLINE = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>|<style\b|\sstyle=|\son[a-z]+=", re.IGNORECASE)
REFERENCED = re.compile(r'(?:src|href)="/console/static/([^"]+)"')


def test_vendored_files_match_their_pinned_sha256() -> None:
    pinned = PINNED.findall((STATIC / "VENDORED.md").read_text(encoding="utf-8"))
    assert {name for name, _, _ in pinned} == {"htmx.min.js", "uPlot.iife.min.js", "uPlot.min.css"}
    for name, _, digest in pinned:
        assert hashlib.sha256((STATIC / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("template", sorted(p.name for p in TEMPLATES.glob("*.html")))
def test_template_has_no_inline_script_or_style(template: str) -> None:
    text = (TEMPLATES / template).read_text(encoding="utf-8")
    assert INLINE.findall(text) == []


def test_every_static_file_a_template_names_is_served() -> None:
    named = {m for p in TEMPLATES.glob("*.html") for m in REFERENCED.findall(p.read_text())}
    assert {"htmx.min.js", "console.css", "health.js", "record.js", "timeline.js"} <= named
    for name in named:
        assert (STATIC / name).is_file(), name
        assert (STATIC / name).suffix in CONTENT_TYPES, name


def test_every_template_compiles_with_autoescape_on() -> None:
    environment = load_templates()
    assert environment.autoescape is True
    page = environment.get_template("login.html").render(
        who=None, path="/console/login", title="<b>", problem="<script>x</script>"
    )
    assert "<script>x" not in page
    assert "&lt;script&gt;x&lt;/script&gt;" in page
