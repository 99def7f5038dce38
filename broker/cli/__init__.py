"""The ``broker`` command line: ``main.py`` (the parser and ``serve``), one module per
command group. Kept import-free: ``entry.py`` imports ``main`` inside a ``try`` to name a
missing ``[server]`` extra."""
