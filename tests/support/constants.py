"""What every test workspace holds (tests/integration/conftest.py ``write_config``)."""

from __future__ import annotations

AUDIENCE = "https://broker.it.invalid"
KEY = "models/llama"  # created in every test broker
GPU_KEY = "models/llama-gpu"
QUERY_KEY = "models/llama-queries"
ALLOWED = "sha256:" + "a1" * 32  # the image digest the test policy allows for each key
DENIED = "sha256:" + "d0" * 32
