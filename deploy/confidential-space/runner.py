"""A sealed runner's entry point on Confidential Space: get the key the weights were encrypted
with from the broker, decrypt the weights into memory-backed storage, then hand over to the
model server.

Configuration comes from the environment, which the operator sets with ``tee-env-*`` metadata
(only the names the image's launch policy allows, see the Dockerfile):

    BROKER_URL        https://broker.prod.example.com
    BROKER_AUDIENCE   the broker's [server] audience (pinned: the token is minted for it)
    BROKER_CA         CA bundle that signs the broker's TLS certificate (baked into the image)
    WEIGHTS_IN        the encrypted weights (BRKW1): gs://bucket/model.safetensors.brkw (the VM's
                      service account reads it), https://…, or a path inside the container
    WEIGHTS_OUT       where the plaintext goes; default /dev/shm/model.safetensors (tmpfs: the
                      plaintext never touches a disk)
    MODEL_KEY         optional: the key name the file must be for (refused if it is not)
    BROKER_ATTEST     ``1`` (default): attest once (``POST /v1/attest``) and release on the
                      attestation result with DPoP proofs; ``0``: one full-evidence release.
                      A broker with attestation results off (404) gets a full-evidence release.

(``TEE_LAUNCHER_SOCKET`` names another launcher socket for tests; the launch policy does not let
an operator set it.)

The key and version come from the file's own header (``key_of_file``): a file made before a key
rotation opens with the version it was made with.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import sys

from broker.client import BrokerClient, BrokerClientError, ConfidentialSpaceTokenSource, ReleasedDek
from broker.client.tokens import LAUNCHER_SOCKET
from broker.client.weights import SourceError, decrypt_to, key_of_file
from broker.crypto.weights import WeightsFormatError

DEFAULT_OUT = "/dev/shm/model.safetensors"  # noqa: S108 - tmpfs in a single-tenant TEE container


async def fetch_and_decrypt(source: str, target: str) -> int:
    tls = ssl.create_default_context(cafile=os.environ["BROKER_CA"])
    async with BrokerClient(
        os.environ["BROKER_URL"], ssl_context=tls, audience=os.environ["BROKER_AUDIENCE"]
    ) as client:
        # The launcher mints the attestation token (audience, nonce, this process's key).
        launcher = ConfidentialSpaceTokenSource(
            os.environ.get("TEE_LAUNCHER_SOCKET") or LAUNCHER_SOCKET
        )
        released = await release(client, launcher, source)
    print(
        f"key {released.key}#{released.version} released: decision {released.decision_id}, "
        f"log index {released.log_index}"
    )
    kid = f"{released.key}#{released.version}"
    return await decrypt_to(source, target, released.dek, kid)


async def release(
    client: BrokerClient, launcher: ConfidentialSpaceTokenSource, source: str
) -> ReleasedDek:
    """The file's key: on an attestation result (attest once, then DPoP-bound releases), or
    with full evidence where the broker issues no results."""
    name, version = await asyncio.to_thread(key_of_file, source, {})
    expected = os.environ.get("MODEL_KEY") or None
    if expected is not None and name != expected:
        raise WeightsFormatError(f"{source} is for key {name!r}, not {expected!r}")
    if os.environ.get("BROKER_ATTEST", "1") != "0":
        try:
            attestation = await client.attest(launcher)
        except BrokerClientError as exc:
            if exc.status != 404:
                raise
        else:
            print(f"attested once: result {attestation.jti} until {attestation.expires_at}")
            return await attestation.release(name, version=version)
    return await client.release(name, launcher, version=version)


def main() -> int:
    source = os.environ["WEIGHTS_IN"]
    target = os.environ.get("WEIGHTS_OUT") or DEFAULT_OUT
    try:
        size = asyncio.run(fetch_and_decrypt(source, target))
    except BrokerClientError as exc:
        print(f"the broker refused: {exc}", file=sys.stderr)
        return 1
    except (WeightsFormatError, SourceError) as exc:
        print(f"the weights cannot be read or do not decrypt: {exc}", file=sys.stderr)
        return 1
    print(f"decrypted {size} bytes to {target}")
    if len(sys.argv) > 1:
        os.execvp(sys.argv[1], sys.argv[1:])  # noqa: S606 - the model server takes over
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
