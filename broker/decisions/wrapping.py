"""The steps a release shares, whatever proved the runner: a key version checked for a wrap,
the request's facts for the policy, and the DEK wrapped to the runner's key."""

from __future__ import annotations

from collections.abc import Callable

from broker.attestation.claims import RequestFacts
from broker.crypto.jwk import RunnerKey
from broker.crypto.wrap import wrap_to_runner
from broker.keys.custody import DekCustody, release_from_custody
from broker.keys.service import KeyService
from broker.keys.store.base import KeyVersionRecord


def request_facts(record: KeyVersionRecord, runner_key: RunnerKey) -> RequestFacts:
    """What the policy input's ``request`` says of a release of ``record`` to ``runner_key``."""
    return RequestFacts(
        key=record.name,
        version=record.version,
        purpose=record.purpose.value,
        runner_key_thumbprint=runner_key.thumbprint,
    )


async def wrap_for_runner(
    keys: KeyService,
    record: KeyVersionRecord,
    custody: DekCustody | None,
    runner_key: RunnerKey,
    *,
    decision_id: str,
    mode: str,
    policy_digest: str | None = None,
    lap: Callable[[str], None] = lambda _: None,
) -> str:
    """The DEK of ``record`` wrapped to ``runner_key`` (in memory only) with the release bound
    into its associated data; an HSM that keeps the DEK (``custody``) unwraps and wraps in one
    call. ``lap`` is told when the unwrap and the wrap end.

    Raises:
        UpstreamError: ``kek_unavailable``; KeyUnavailable for a destroyed version.
    """
    if custody is not None:  # the HSM unwraps and wraps in one call: timed as "wrap"
        lap("unwrap")
        wrapped = await release_from_custody(
            custody, record, runner_key, decision_id=decision_id, policy_digest=policy_digest
        )
        lap("wrap")
        return wrapped
    dek = await keys.unwrap(record)
    lap("unwrap")
    wrapped = wrap_to_runner(
        dek,
        runner_key,
        name=record.name,
        version=record.version,
        decision_id=decision_id,
        mode=mode,
        policy_digest=policy_digest,
    )
    lap("wrap")
    return wrapped
