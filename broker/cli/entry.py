"""The ``broker`` console script: ``broker.cli.main``, or one line naming the missing extra.

The wheel's base install is the runner SDK (``broker.client``) alone; the command line needs the
``[server]`` extra. Without it, ``broker`` says so (exit 2) instead of a traceback on the first
server module it imports (``pkcs11``, ``wasmtime``, …).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

EXIT_USAGE = 2
INSTALL = "pip install 'sealed-runner-broker[server]' (from a wheel: pip install '<wheel>[server]')"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; a server dependency that is not installed is a one-line error, exit 2."""
    try:
        from broker.cli.main import main as run  # noqa: PLC0415 - the import is what may fail

        return run(argv)
    except ModuleNotFoundError as exc:
        missing = exc.name or "?"
        if missing.split(".")[0] == "broker":
            raise  # a broken installation of this package itself: not a missing extra
        print(
            f"error: the broker command needs the [server] extra (no module {missing!r}): "
            f"{INSTALL}",
            file=sys.stderr,
        )
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
