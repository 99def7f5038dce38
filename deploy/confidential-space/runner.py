"""A sealed runner's entry point on Confidential Space: get the keys the weights were encrypted
with from the broker, decrypt the weights into memory-backed storage, then hand over to the
model server.

Configuration comes from the environment, which the operator sets with ``tee-env-*`` metadata
(only the names the image's launch policy allows, see the Dockerfile):

    BROKER_URL        https://broker.prod.example.com
    BROKER_AUDIENCE   the broker's [server] audience (pinned: the token is minted for it)
    BROKER_CA         CA bundle that signs the broker's TLS certificate (baked into the image)
    WEIGHTS_IN        the encrypted weights (BRKW1): gs://bucket/model.safetensors.brkw (the VM's
                      service account reads it), https://…, or a path inside the container;
                      several files separated by commas (a sharded model, a tokenizer, …)
    WEIGHTS_OUT       where the plaintext goes; default /dev/shm/model.safetensors (tmpfs: the
                      plaintext never touches a disk). With several files: one target per file
                      (commas, in the same order), or a directory ending in ``/`` (each file
                      lands there under its own name without ``.brkw``)
    MODEL_KEY         optional: the key name every file must be for (refused if one is not)
    BROKER_ATTEST     ``1`` (default): attest once (``POST /v1/attest``) and release every
                      file's key in one request on the attestation result (16 keys a request,
                      DPoP proofs); ``0``: one full-evidence release per distinct key.
                      A broker with attestation results off (404) gets full-evidence releases.

(``TEE_LAUNCHER_SOCKET`` names another launcher socket for tests; the launch policy does not let
an operator set it.)

The key and version come from each file's own header (``key_of_file``): a file made before a key
rotation opens with the version it was made with. Every header is read, and every key released,
before any plaintext is written; every file is decrypted to ``<target>.partial`` and renamed into
place only once all of them authenticated (a failure removes every ``.partial``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import sys
from pathlib import PurePosixPath
from urllib.parse import urlsplit

from broker.client import BrokerClient, BrokerClientError, ConfidentialSpaceTokenSource, ReleasedDek
from broker.client.tokens import LAUNCHER_SOCKET
from broker.client.weights import SourceError, decrypt_to
from broker.crypto.weights import WeightsFormatError

DEFAULT_OUT = "/dev/shm/model.safetensors"  # noqa: S108 - tmpfs in a single-tenant TEE container
SEALED_SUFFIX = ".brkw"
PARTIAL = ".partial"  # a file decrypted, waiting for every other file to authenticate


class ConfigurationError(ValueError):
    """``WEIGHTS_IN`` / ``WEIGHTS_OUT`` do not say which file goes where."""


def files_to_open(weights_in: str, weights_out: str) -> list[tuple[str, str]]:
    """``(source, target)`` for each file of ``WEIGHTS_IN``.

    Raises:
        ConfigurationError: an empty entry, a count of targets that does not match, two
            files that would land on one target, or a target that is another's staging file.
    """
    sources = [item.strip() for item in weights_in.split(",")]
    targets = [item.strip() for item in weights_out.split(",")]
    if not all(sources) or not all(targets):
        raise ConfigurationError("WEIGHTS_IN and WEIGHTS_OUT must not have empty entries")
    if len(targets) == 1 and targets[0].endswith("/"):
        targets = [targets[0] + own_name(source) for source in sources]
    elif len(targets) != len(sources):
        raise ConfigurationError(
            f"WEIGHTS_IN lists {len(sources)} files: WEIGHTS_OUT must list as many targets, "
            "or be a directory ending in /"
        )
    if len(set(targets)) != len(targets):
        raise ConfigurationError("two WEIGHTS_IN files would be written to one target")
    if set(targets) & {target + PARTIAL for target in targets}:
        raise ConfigurationError(f"a target is another target's {PARTIAL} (where it is staged)")
    return list(zip(sources, targets, strict=True))


def own_name(source: str) -> str:
    """The plaintext's name for ``source``: its last path segment without ``.brkw``.

    Raises:
        ConfigurationError: the source names no file.
    """
    name = PurePosixPath(urlsplit(source).path).name.removesuffix(SEALED_SUFFIX)
    if not name or name in {".", ".."}:
        raise ConfigurationError(f"{source} names no file to write into a directory")
    return name


async def fetch_and_decrypt(files: list[tuple[str, str]]) -> int:
    tls = ssl.create_default_context(cafile=os.environ["BROKER_CA"])
    async with BrokerClient(
        os.environ["BROKER_URL"], ssl_context=tls, audience=os.environ["BROKER_AUDIENCE"]
    ) as client:
        # The launcher mints the attestation token (audience, nonce, this process's keys).
        launcher = ConfidentialSpaceTokenSource(
            os.environ.get("TEE_LAUNCHER_SOCKET") or LAUNCHER_SOCKET
        )
        keys = await release(client, launcher, [source for source, _ in files])
    for (source, _), released in zip(files, keys, strict=True):
        print(
            f"{source}: key {released.key}#{released.version} released: decision "
            f"{released.decision_id}, log index {released.log_index}"
        )
    return await decrypt_all(files, keys)


async def decrypt_all(files: list[tuple[str, str]], keys: list[ReleasedDek]) -> int:
    """Every file decrypted to ``<target>.partial`` (0600, beside its target), and all renamed
    only once every file has authenticated: a file that fails (a flipped bit in a later shard)
    leaves no plaintext of any file behind, so the model server never starts on part of a model.

    Raises:
        WeightsFormatError, SourceError: a file cannot be read or does not authenticate.
    """
    staged = [(f"{target}{PARTIAL}", target) for _, target in files]
    sizes: list[int] = []
    placed: list[str] = []
    try:
        for (source, _), (partial, _), released in zip(files, staged, keys, strict=True):
            kid = f"{released.key}#{released.version}"
            sizes.append(await decrypt_to(source, partial, released.dek, kid))
        for partial, target in staged:
            await asyncio.to_thread(os.replace, partial, target)
            placed.append(target)
    except BaseException:
        # synchronous, so that nothing (a second interrupt) cuts the clean-up short; a few
        # unlinks, and nothing else runs on this loop
        _remove([partial for partial, _ in staged] + placed)
        raise
    for (_, target), size in zip(staged, sizes, strict=True):
        print(f"decrypted {size} bytes to {target}")
    return sum(sizes)


def _remove(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def release(
    client: BrokerClient, launcher: ConfidentialSpaceTokenSource, sources: list[str]
) -> list[ReleasedDek]:
    """Each file's key: every header read first, then one attestation and one request for all
    distinct keys (``BrokerClient.release_many_for``), or full-evidence releases where the
    broker issues no results (or ``BROKER_ATTEST=0``).

    Raises:
        BrokerClientError: the first refusal (of the attestation, a request, or one key).
        WeightsFormatError, SourceError: a file cannot be read or is for another key.
    """
    results = await client.release_many_for(
        sources,
        launcher,
        expected_key=os.environ.get("MODEL_KEY") or None,
        attest=os.environ.get("BROKER_ATTEST", "1") != "0",
    )
    released: list[ReleasedDek] = []
    for result in results:
        if isinstance(result, BrokerClientError):
            raise result
        released.append(result)
    return released


def main() -> int:
    try:
        files = files_to_open(
            os.environ.get("WEIGHTS_IN", ""), os.environ.get("WEIGHTS_OUT") or DEFAULT_OUT
        )
        size = asyncio.run(fetch_and_decrypt(files))
    except ConfigurationError as exc:
        print(f"the runner is misconfigured: {exc}", file=sys.stderr)
        return 2
    except BrokerClientError as exc:
        print(f"the broker refused: {exc}", file=sys.stderr)
        return 1
    except (WeightsFormatError, SourceError) as exc:
        print(f"the weights cannot be read or do not decrypt: {exc}", file=sys.stderr)
        return 1
    print(f"decrypted {len(files)} files, {size} bytes")
    if len(sys.argv) > 1:
        os.execvp(sys.argv[1], sys.argv[1:])  # noqa: S606 - the model server takes over
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
