"""``python -m broker.cli`` (the supervisor starts its workers so)."""

import sys

from broker.cli.main import main

sys.exit(main())
