"""The console's templates: Jinja2 with autoescaping on for every template, read once.

Every template is read into memory when the app starts (in a thread) and never again: a
request renders from memory and touches no file. Autoescaping is on whatever a template's name
ends with, and undefined names fail (``StrictUndefined``) rather than render empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web

from broker.console.session import SESSION

TEMPLATES = Path(__file__).parent / "templates"
ENVIRONMENT: web.AppKey[jinja2.Environment] = web.AppKey("console_templates", jinja2.Environment)


def load_templates() -> jinja2.Environment:
    """Every template of ``templates/``, compiled. Blocking (reads the files)."""
    sources = {p.name: p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.html"))}
    environment = jinja2.Environment(
        loader=jinja2.DictLoader(sources),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        auto_reload=False,
    )
    for name in sources:
        environment.get_template(name)  # compile now: a template error fails the start-up
    return environment


def render(request: web.Request, name: str, *, status: int = 200, **context: Any) -> web.Response:
    """``name`` rendered as a page (``text/html``)."""
    session = request.get(SESSION)
    text = (
        request.app[ENVIRONMENT]
        .get_template(name)
        .render(who=None if session is None else session.who, path=request.path, **context)
    )
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")
