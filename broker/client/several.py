"""Several keys in one call (issue 31): what ``BrokerClient.release_many_for`` and
``BrokerClient.release_many`` run.

A runner with several files (a sharded model, weights and a tokenizer) or several start-up keys
(weights key and query key) attests once and asks for every distinct key and version in one
release on the result (``Attestation.release_versions``: ``MAX_KEYS_PER_REQUEST`` a request, one
DPoP proof and one decision record each), instead of one full-evidence release per file. Where
the broker issues no attestation results (``POST /v1/attest`` answers 404: ``[attest]`` off), each
distinct key gets one full-evidence release, as the Confidential Space runner has always fallen
back. Any other refusal of the attestation is raised: it is the broker's answer about this runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from broker.client.attested import Attestation
from broker.client.sdk import BrokerClientError
from broker.client.tokens import TokenSource
from broker.client.unwrap import ReleasedDek

if TYPE_CHECKING:
    from broker.client.sdk import BrokerClient

ATTEST_OPTIONS = ("gpu_source", "key_type", "wrap")  # release options ``attest`` takes too
NO_RESULTS_STATUS = 404  # ``POST /v1/attest`` on a broker with ``[attest]`` off


async def attest_if_offered(
    client: BrokerClient, token_source: TokenSource, release_options: dict[str, Any]
) -> Attestation | None:
    """An attestation result, or ``None`` where the broker issues none (404).

    Raises:
        BrokerClientError: the attestation was refused for another reason (policy, binding,
            transport).
    """
    options = {k: v for k, v in release_options.items() if k in ATTEST_OPTIONS}
    try:
        return await client.attest(token_source, **options)
    except BrokerClientError as exc:
        if exc.status != NO_RESULTS_STATUS:
            raise
        return None


async def release_asks(
    client: BrokerClient,
    asks: Sequence[tuple[str, int | None]],
    token_source: TokenSource,
    *,
    attest: bool,
    release_options: dict[str, Any],
) -> list[ReleasedDek | BrokerClientError]:
    """Each ``(key, version)`` asked, in order: on one attestation result where the broker
    offers them (and ``attest``), else one full-evidence release per distinct ask.

    Raises:
        BrokerClientError: as ``attest_if_offered``; a release request refused as a whole; or
            no answer from the broker (``TRANSPORT_CODES``).
        jwe.JweError: a wrapped key does not open for its release.
    """
    if not asks:
        return []
    attestation = await attest_if_offered(client, token_source, release_options) if attest else None
    if attestation is not None:
        return await attestation.release_versions(asks)
    answers: dict[tuple[str, int | None], ReleasedDek | BrokerClientError] = {}
    for name, version in dict.fromkeys(asks):
        try:
            answers[name, version] = await client.release(
                name, token_source, version=version, **release_options
            )
        except BrokerClientError as exc:
            if exc.status == 0:  # no answer at all: the next key would fare no better
                raise
            answers[name, version] = exc  # this key's refusal, as on a result
    return [answers[ask] for ask in asks]
