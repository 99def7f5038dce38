"""A sealed runner's entry point on Confidential Space: get the model's key from the broker,
decrypt the weights into memory-backed storage, then hand over to the model server.

Configuration comes from the environment, which the operator sets with ``tee-env-*`` metadata
(only the names the image's launch policy allows, see the Dockerfile):

    BROKER_URL        https://broker.prod.example.com
    BROKER_AUDIENCE   the broker's [server] audience (pinned: the token is minted for it)
    BROKER_CA         CA bundle that signs the broker's TLS certificate (baked into the image)
    MODEL_KEY         the key name, e.g. models/llama
    WEIGHTS_IN        the encrypted weights file (BRKW1), e.g. /weights/model.safetensors.brkw
    WEIGHTS_OUT       where the plaintext goes, e.g. /dev/shm/model.safetensors
"""

from __future__ import annotations

import asyncio
import os
import ssl
import sys

from broker.client import BrokerClient, BrokerClientError, ConfidentialSpaceTokenSource
from broker.crypto.weights import WeightsFormatError, decrypt_stream


async def fetch_key() -> tuple[bytes, str]:
    tls = ssl.create_default_context(cafile=os.environ["BROKER_CA"])
    async with BrokerClient(
        os.environ["BROKER_URL"], ssl_context=tls, audience=os.environ["BROKER_AUDIENCE"]
    ) as client:
        # The launcher mints the attestation token (audience, nonce, this process's key).
        released = await client.release(os.environ["MODEL_KEY"], ConfidentialSpaceTokenSource())
    print(f"key released: decision {released.decision_id}, log index {released.log_index}")
    return released.dek, f"{released.key}#{released.version}"


def main() -> int:
    try:
        dek, kid = asyncio.run(fetch_key())
        with (
            open(os.environ["WEIGHTS_IN"], "rb") as source,
            open(os.environ["WEIGHTS_OUT"], "wb") as sink,
        ):
            decrypt_stream(dek, kid, source, sink)
    except BrokerClientError as exc:
        print(f"the broker refused: {exc}", file=sys.stderr)
        return 1
    except WeightsFormatError as exc:
        print(f"the weights do not decrypt: {exc}", file=sys.stderr)
        return 1
    if len(sys.argv) > 1:
        os.execvp(sys.argv[1], sys.argv[1:])  # noqa: S606 - the model server takes over
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
