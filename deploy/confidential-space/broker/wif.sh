#!/usr/bin/env bash
# The KEK serves only the attested broker: Workload Identity Federation for Cloud KMS.
#
# Creates, in the project that holds the keys (run it as that project's key owner, not as the
# broker's operator: whoever can change this provider or the key's IAM policy decides who
# decrypts):
#   1. a workload identity pool and an OIDC provider that trusts Confidential Space attestation
#      tokens (issuer https://confidentialcomputing.googleapis.com/, audience
#      https://sts.googleapis.com: the token the launcher writes to
#      /run/container_launcher/attestation_verifier_claims_token) and admits only tokens that
#      satisfy wif-condition.cel (this image digest, production Confidential Space, STABLE
#      support, not a debug image). The subject is "gcpcs::DIGEST::PROJECT_NUMBER::INSTANCE_ID"
#      (as Google's Confidential Space codelabs map it): the token's sub, the VM's selfLink, can
#      pass the 127-byte limit on google.subject;
#   2. a key ring and a symmetric key (the broker's KEK);
#   3. the key's IAM binding: roles/cloudkms.cryptoKeyEncrypterDecrypter for the principal set
#      of this image digest only (attribute.image_digest);
#   4. the credential configuration the broker reads ([keys] kms_credentials): google-auth
#      exchanges the attestation token at the STS; no service-account key exists anywhere.
#
# Environment (required): PROJECT_ID, PROJECT_NUMBER (of PROJECT_ID), REGION (the key ring's
# location), IMAGE_DIGEST (sha256:<64 hex>, the broker image `make image` built).
# Optional: POOL (broker-pool), PROVIDER (broker-attestation), KEYRING (broker), KEY (broker-kek),
# PROTECTION_LEVEL (hsm | software; hsm), OUTPUT (kms-credentials.json), SIGNING_KEYS (names of
# asymmetric keys in the ring that sign checkpoints or attestation results: granted
# roles/cloudkms.signerVerifier the same way).
#
# A new image: run again with the new IMAGE_DIGEST (the provider's condition is updated and the
# new digest is bound), then remove the old digest's binding:
#   gcloud kms keys remove-iam-policy-binding "$KEY" --keyring="$KEYRING" --location="$REGION" \
#     --project="$PROJECT_ID" --role=roles/cloudkms.cryptoKeyEncrypterDecrypter \
#     --member="principalSet://iam.googleapis.com/projects/$PROJECT_NUMBER/locations/global/workloadIdentityPools/$POOL/attribute.image_digest/OLD_DIGEST"
set -euo pipefail

: "${PROJECT_ID:?set PROJECT_ID: the project that holds the keys and the pool}"
: "${PROJECT_NUMBER:?set PROJECT_NUMBER: the number of PROJECT_ID (gcloud projects describe)}"
: "${REGION:?set REGION: the location of the key ring, e.g. us-central1}"
: "${IMAGE_DIGEST:?set IMAGE_DIGEST: sha256:<64 hex> of the broker image}"
POOL="${POOL:-broker-pool}"
PROVIDER="${PROVIDER:-broker-attestation}"
KEYRING="${KEYRING:-broker}"
KEY="${KEY:-broker-kek}"
PROTECTION_LEVEL="${PROTECTION_LEVEL:-hsm}"
OUTPUT="${OUTPUT:-kms-credentials.json}"
SIGNING_KEYS="${SIGNING_KEYS:-}"

# The digest is spliced into a CEL expression and an IAM member: only its one spelling passes.
if [[ ! "$IMAGE_DIGEST" =~ ^sha256:[0-9a-f]{64}$ ]]; then
  echo "IMAGE_DIGEST must be sha256: and 64 lower-case hex digits" >&2
  exit 2
fi
if [[ ! "$PROJECT_NUMBER" =~ ^[0-9]+$ ]]; then
  echo "PROJECT_NUMBER must be the project's number (digits), not its id" >&2
  exit 2
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
template="$(<"$here/wif-condition.cel")"
condition="${template//@IMAGE_DIGEST@/$IMAGE_DIGEST}"
condition="${condition//$'\n'/ }"

pool_name="projects/$PROJECT_NUMBER/locations/global/workloadIdentityPools/$POOL"
member="principalSet://iam.googleapis.com/$pool_name/attribute.image_digest/$IMAGE_DIGEST"

# 1. Pool and provider.
if ! gcloud iam workload-identity-pools describe "$POOL" \
  --project="$PROJECT_ID" --location=global >/dev/null 2>&1; then
  gcloud iam workload-identity-pools create "$POOL" \
    --project="$PROJECT_ID" --location=global \
    --display-name="Sealed key broker"
fi
provider_flags=(
  --project="$PROJECT_ID"
  --location=global
  --workload-identity-pool="$POOL"
  --issuer-uri="https://confidentialcomputing.googleapis.com/"
  --allowed-audiences="https://sts.googleapis.com"
  --attribute-mapping='google.subject="gcpcs::"+assertion.submods.container.image_digest+"::"+assertion.submods.gce.project_number+"::"+assertion.submods.gce.instance_id,attribute.image_digest=assertion.submods.container.image_digest'
  --attribute-condition="$condition"
)
if gcloud iam workload-identity-pools providers describe "$PROVIDER" \
  --project="$PROJECT_ID" --location=global --workload-identity-pool="$POOL" >/dev/null 2>&1; then
  gcloud iam workload-identity-pools providers update-oidc "$PROVIDER" "${provider_flags[@]}"
else
  gcloud iam workload-identity-pools providers create-oidc "$PROVIDER" "${provider_flags[@]}"
fi

# 2. Key ring and KEK.
if ! gcloud kms keyrings describe "$KEYRING" \
  --project="$PROJECT_ID" --location="$REGION" >/dev/null 2>&1; then
  gcloud kms keyrings create "$KEYRING" --project="$PROJECT_ID" --location="$REGION"
fi
if ! gcloud kms keys describe "$KEY" \
  --project="$PROJECT_ID" --location="$REGION" --keyring="$KEYRING" >/dev/null 2>&1; then
  gcloud kms keys create "$KEY" \
    --project="$PROJECT_ID" --location="$REGION" --keyring="$KEYRING" \
    --purpose=encryption --protection-level="$PROTECTION_LEVEL"
fi

# 3. Only this image digest may use the keys.
gcloud kms keys add-iam-policy-binding "$KEY" \
  --project="$PROJECT_ID" --location="$REGION" --keyring="$KEYRING" \
  --role=roles/cloudkms.cryptoKeyEncrypterDecrypter \
  --member="$member"
for signing_key in $SIGNING_KEYS; do
  gcloud kms keys add-iam-policy-binding "$signing_key" \
    --project="$PROJECT_ID" --location="$REGION" --keyring="$KEYRING" \
    --role=roles/cloudkms.signerVerifier \
    --member="$member"
done

# 4. The broker's credential configuration: its attestation token, exchanged at the STS.
gcloud iam workload-identity-pools create-cred-config \
  "$pool_name/providers/$PROVIDER" \
  --credential-source-file=/run/container_launcher/attestation_verifier_claims_token \
  --output-file="$OUTPUT"

cat <<EOF
Done. In the broker's configuration:
  [keys]
  kek = "cloudkms:projects/$PROJECT_ID/locations/$REGION/keyRings/$KEYRING/cryptoKeys/$KEY"
  kms_credentials = "/path/in/the/image/$(basename "$OUTPUT")"
EOF
