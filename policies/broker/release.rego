# Default release policy: data.broker.release.allow / data.broker.release.reasons.
#
# Every condition is a positive rule; `allow` needs all of them, so an input that lacks a field
# (or a typo in a field name) can only deny. `reasons` names each condition that failed.
package broker.release

import rego.v1

import data.broker.kbs

default allow := false

allow if {
	confidential_space
	production_image
	hardware_tee
	image_allowed
	gpus_acceptable
	count(key_requirement_failures) == 0
	count(key_policy_denials) == 0
}

# A Confidential Containers guest over the KBS protocol (docs/kbs.md): its measurements on the
# key's references (below) instead of an image digest; GPUs and per-key policies as for any
# runner. A key with requirements (key_requirements: Confidential Space fields) is never
# released to one: its evidence has none of the fields they test.
allow if {
	kbs_guest_allowed
	gpus_acceptable
	not data.broker.key_requirements[input.request.key]
	count(key_policy_denials) == 0
}

# The evidence came from a verified Google Cloud Attestation token for Confidential Space.
confidential_space if {
	input.tee.verifier == "gca"
	input.tee.software.name == "CONFIDENTIAL_SPACE"
}

# Production image: not debug, secure boot on, and an image release Google supports as STABLE.
production_image if {
	input.tee.debug == false
	input.tee.secure_boot == true
	supported_release
}

# Positive helpers: `not x in y` is never used on a field of the input. OPA evaluates a call's
# arguments outside the `not`, so when `x` is missing the whole rule is undefined (it neither
# denies nor explains); `not helper` is true when the field is missing.
supported_release if data.broker.required_support in input.tee.software.support

hardware_tee if input.tee.technology in data.broker.hardware_tees

# The workload's image digest is on the allow-list of the requested key.
image_allowed if input.tee.workload.image_digest in data.broker.images[input.request.key]

reasons contains "evidence is not a Confidential Space attestation" if {
	not kbs.guest
	not confidential_space
}

reasons contains "debug image: a production Confidential Space image is required" if {
	not kbs.guest
	input.tee.debug != false
}

reasons contains "secure boot is not on" if {
	not kbs.guest
	not input.tee.secure_boot == true
}

reasons contains msg if {
	not kbs.guest
	not supported_release
	msg := sprintf("image lacks the %s support attribute", [data.broker.required_support])
}

reasons contains msg if {
	not kbs.guest
	not hardware_tee
	msg := sprintf("technology '%v' is not an allowed hardware TEE", [input.tee.technology])
}

reasons contains msg if {
	not kbs.guest
	not image_allowed
	msg := sprintf("image %s is not allowed for key %s", [
		input.tee.workload.image_digest,
		input.request.key,
	])
}

# --- GPUs --------------------------------------------------------------------------------------
# Keys listed in data.broker.gpu_keys need attested GPUs (NRAS or local verification, the same
# fields either way); other keys accept but do not need GPU evidence.

gpu_policy := data.broker.gpu_keys[input.request.key]

gpus_acceptable if not data.broker.gpu_keys[input.request.key]

gpus_acceptable if {
	gpu_policy
	count(input.gpus) >= gpu_policy.min_gpus
	one_gpu_mode
	every gpu in input.gpus {
		gpu_ok(gpu)
	}
}

# All of a runner's GPUs run in one mode (single-GPU passthrough "spt", multi-GPU "mpt" or
# protected PCIe "ppcie", from the report's feature flag): a mix means some GPUs are not
# protected the way the others are. Evidence that does not state it reads "unknown".
gpu_modes contains mode if {
	some gpu in input.gpus
	mode := object.get(gpu, "mode", "unknown")
}

one_gpu_mode if count(gpu_modes) <= 1

reasons contains msg if {
	gpu_policy
	not one_gpu_mode
	modes := [m | some m in gpu_modes; is_string(m)]
	msg := concat("", ["GPUs run in mixed modes (", concat(", ", sort(modes)), "); one mode is required"])
}

# A GPU is acceptable only if every condition holds (a missing field fails its condition).
gpu_ok(gpu) if {
	gpu_arch_allowed(gpu)
	gpu.cc_mode == "on"
	gpu.debug == false
	gpu.measurements == "match"
	gpu.cert_chain == "valid"
	ocsp_acceptable(gpu)
	version_at_least(gpu.driver_version, gpu_policy.min_driver)
}

gpu_arch_allowed(gpu) if gpu.arch in {"HOPPER", "BLACKWELL"}

# Reasons name what failed; they explain a deny, they never cause an allow.
reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not gpu_arch_allowed(gpu)
	msg := sprintf("GPU %v: architecture %v is not allowed", [object.get(gpu, "id", null), object.get(gpu, "arch", null)])
}

reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not gpu.cc_mode == "on"
	msg := sprintf("GPU %v: confidential computing mode is %v, not on", [object.get(gpu, "id", null), object.get(gpu, "cc_mode", null)])
}

reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not gpu.debug == false
	msg := sprintf("GPU %v: debug mode is %v", [object.get(gpu, "id", null), object.get(gpu, "debug", null)])
}

reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not gpu.measurements == "match"
	msg := sprintf("GPU %v: measurements %v", [object.get(gpu, "id", null), object.get(gpu, "measurements", null)])
}

reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not gpu.cert_chain == "valid"
	msg := sprintf("GPU %v: certificate chain %v", [object.get(gpu, "id", null), object.get(gpu, "cert_chain", null)])
}

reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not ocsp_acceptable(gpu)
	msg := sprintf("GPU %v: device certificate status %v", [object.get(gpu, "id", null), object.get(gpu, "ocsp", null)])
}

reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not version_at_least(gpu.driver_version, gpu_policy.min_driver)
	msg := sprintf("GPU %v: driver %v is older than %v", [
		object.get(gpu, "id", null),
		object.get(gpu, "driver_version", null),
		gpu_policy.min_driver,
	])
}

# Revocation must be checked and good; a key may opt in to accepting "unknown" (no responder
# configured or reachable, or an NRAS result without OCSP claims) with "ocsp_unknown_ok": true.
ocsp_acceptable(gpu) if gpu.ocsp == "good"

ocsp_acceptable(gpu) if {
	gpu.ocsp == "unknown"
	gpu_policy.ocsp_unknown_ok == true
}

# "550.90.07" >= "550.54" compared numerically, part by part (at most 3 parts of < 1000 each).
# The pattern comes first: to_number differs at the edges between OPA's evaluators (Go's accepts
# "550_1", OPA's Wasm runtime does not), and a version is digits and dots, nothing else.
version_at_least(have, want) if version_number(have) >= version_number(want)

version_number(v) := n if {
	regex.match(`^[0-9]{1,3}(\.[0-9]{1,3}){0,2}$`, v)
	parts := [to_number(p) | some p in split(v, ".")]
	padded := array.concat(parts, [0, 0, 0])
	n := (((padded[0] * 1000) + padded[1]) * 1000) + padded[2]
}

reasons contains msg if {
	gpu_policy
	count(input.gpus) < gpu_policy.min_gpus
	msg := sprintf("key %v needs at least %v attested GPU(s), got %v", [
		input.request.key,
		gpu_policy.min_gpus,
		count(input.gpus),
	])
}

reasons contains msg if {
	gpu_policy
	some gpu in input.gpus
	not gpu_ok(gpu)
	msg := sprintf("GPU %v is not acceptable", [object.get(gpu, "id", null)])
}

# --- Per-key requirements (data) ---------------------------------------------------------------
# data.broker.key_requirements[<key>] may list, each optional:
#   image_signers   key ids; the image must carry a cosign signature by one of them
#   projects, zones GCE project ids / zones the VM must run in
#   restart_policy  the container restart policy (Never, Always, OnFailure)
#   env             {NAME: value} the container environment must have exactly
#   args            the exact container arguments
# Every listed requirement must hold; a missing or malformed claim fails it.
# (undefined when the key has none: then no requirement can fail)
key_requirements := data.broker.key_requirements[input.request.key]

key_requirement_failures contains "image_signers" if {
	key_requirements.image_signers
	not signed_by_allowed_signer
}

signed_by_allowed_signer if {
	some signature in input.tee.workload.signatures
	signature.key_id in key_requirements.image_signers
}

key_requirement_failures contains "projects" if {
	key_requirements.projects
	not in_allowed_project
}

in_allowed_project if input.tee.platform.project_id in key_requirements.projects

key_requirement_failures contains "zones" if {
	key_requirements.zones
	not in_allowed_zone
}

in_allowed_zone if input.tee.platform.zone in key_requirements.zones

key_requirement_failures contains "restart_policy" if {
	key_requirements.restart_policy
	not input.tee.workload.restart_policy == key_requirements.restart_policy
}

key_requirement_failures contains "env" if {
	some name, value in key_requirements.env
	not input.tee.workload.env[name] == value
}

key_requirement_failures contains "args" if {
	key_requirements.args
	not input.tee.workload.args == key_requirements.args
}

reasons contains concat("", ["key ", input.request.key, " requires ", failed]) if {
	some failed in key_requirement_failures
	is_string(input.request.key)
}

# --- Per-key policies (Rego) ---------------------------------------------------------------------
# A module in package broker.key_policies.<name> names the keys it governs in `applies_to`
# (exact names, or prefixes ending in "/") and adds reasons to `deny`. It can only narrow access
# to those keys: nothing outside this file defines data.broker.release (`broker policy check`
# and every load refuse a module that tries). See docs/policy.md for a worked example.
key_policy_applies(policy) if input.request.key in policy.applies_to

key_policy_applies(policy) if {
	some prefix in policy.applies_to
	endswith(prefix, "/")
	startswith(input.request.key, prefix)
}

key_policy_denials contains reason if {
	some policy in data.broker.key_policies
	key_policy_applies(policy)
	some reason in policy.deny
}

reasons contains reason if some reason in key_policy_denials

# --- Confidential Containers guests (the KBS facade, docs/kbs.md) -------------------------------
# A guest whose evidence matches one of data.broker.kbs_guests[<key>]'s references: measurements
# and TCB as kbs.rego judges them (its comment says how).
kbs_guest_allowed if {
	kbs.production
	some reference in data.broker.kbs_guests[input.request.key]
	kbs.reference_matches(reference)
}

reasons contains "KBS guest: debug, or evidence the broker did not verify" if {
	kbs.guest
	not kbs.production
}

reasons contains msg if {
	kbs.guest
	data.broker.key_requirements[input.request.key]
	msg := sprintf("key %v has requirements only a Confidential Space runner can meet", [input.request.key])
}

reasons contains msg if {
	kbs.guest
	some reference in data.broker.kbs_guests[input.request.key]
	not kbs.reference_valid(reference)
	msg := sprintf("key %v: a kbs_guests reference is not an object of technology, non-empty measurements and optionally tcb_statuses, snp_min_tcb: it matches nothing", [input.request.key])
}

reasons contains msg if {
	kbs.production
	not kbs_measured_for_key
	msg := sprintf("KBS guest (%v) with these measurements is not allowed for key %v", [
		input.tee.technology,
		input.request.key,
	])
}

kbs_measured_for_key if {
	some reference in data.broker.kbs_guests[input.request.key]
	kbs.measured(reference)
}

reasons contains msg if {
	kbs.production
	not kbs_guest_allowed
	some reference in data.broker.kbs_guests[input.request.key]
	kbs.measured(reference)
	not kbs.tcb_acceptable(reference)
	msg := kbs.tcb_refusal(reference)
}
