"""The auditor console (``/console``, docs/console.md): read-only pages served by the broker,
for the holders of an ``auditor`` token, that verify the log's checkpoints and proofs in the
browser.

* ``session.py`` — the session cookie: signed, short-lived, shared by every worker through a
  key file beside the log; logout revokes it for every worker.
* ``auth.py`` — log in (a POST form, the token never in a URL), log out, the session check
  every console route but the login page and the static files runs, and the ``Origin`` check on
  every POST.
* ``web.py`` — the route table, the templates (Jinja2, autoescaped), the security headers
  (a strict Content-Security-Policy) on every console response.
* ``health.py``, ``timeline.py``, ``denials.py`` — the pages; their records are read through
  the query code of ``broker audit query`` (``cli/audit_query.py``).
"""
