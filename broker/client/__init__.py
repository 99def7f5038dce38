"""Sealed-runner SDK: challenge, ephemeral key, attestation token, release, unwrap.

Typical use inside a Confidential Space workload::

    async with BrokerClient("https://broker.example:8443", ssl=ctx) as client:
        released = await client.release("models/llama", ConfidentialSpaceTokenSource())
        dek = released.dek  # 32 bytes, for this process only

The ephemeral key pair is made in process memory (inside the TEE) for each release and its
thumbprint is bound into the attestation token together with the broker's nonce, so the
wrapped key is useful only to this process.
"""

from broker.client.attested import Attestation
from broker.client.broker_identity import BrokerIdentity, VerifiedBrokerIdentity
from broker.client.identity import Identity
from broker.client.sdk import BrokerClient, BrokerClientError, ProofError, Proven
from broker.client.tokens import ConfidentialSpaceTokenSource, GpuEvidenceSource, TokenSource
from broker.client.unwrap import ReleasedDek

__all__ = [
    "Attestation",
    "BrokerClient",
    "BrokerIdentity",
    "BrokerClientError",
    "ConfidentialSpaceTokenSource",
    "GpuEvidenceSource",
    "Identity",
    "ProofError",
    "Proven",
    "ReleasedDek",
    "TokenSource",
    "VerifiedBrokerIdentity",
]
