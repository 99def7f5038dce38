# Default attestation policy: data.broker.attest.allow / data.broker.attest.reasons.
#
# POST /v1/attest asks it (input.request.kind == "attest") before an attestation result (EAR)
# is signed; every key released on that result is then decided again by data.broker.release
# for that key. So this policy says what a runner must be to hold a result at all; the per-key
# allow-lists stay in the release policy. Positive rules only: a missing field denies.
package broker.attest

import rego.v1

import data.broker.kbs

default allow := false

allow if {
	confidential_space
	production_image
	hardware_tee
	image_known
}

# A Confidential Containers guest over the KBS protocol (docs/kbs.md) gets a result when some key
# may be released to it (data.broker.kbs_guests, below).
allow if {
	kbs.production
	kbs_guest_known
}

confidential_space if {
	input.tee.verifier == "gca"
	input.tee.software.name == "CONFIDENTIAL_SPACE"
}

production_image if {
	input.tee.debug == false
	input.tee.secure_boot == true
	supported_release
}

# Positive helper (not `not x in y` on an input field: see release.rego).
supported_release if data.broker.required_support in input.tee.software.support

hardware_tee if input.tee.technology in data.broker.hardware_tees

# The image is on the allow-list of at least one key: an image no key allows gets no result.
image_known if {
	some key
	input.tee.workload.image_digest in data.broker.images[key]
}

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
	not image_known
	msg := sprintf("image %s is not allowed for any key", [input.tee.workload.image_digest])
}

# --- Confidential Containers guests (the KBS facade, docs/kbs.md) -------------------------------
# Raw evidence the broker verified itself, not debug, that one of some key's references in
# data.broker.kbs_guests matches: measurements and TCB judged by kbs.rego's functions
# (reference_matches: its comment says how), the same release.rego asks, so they cannot drift.
kbs_guest_known if {
	some key
	some reference in data.broker.kbs_guests[key]
	kbs.reference_matches(reference)
}

kbs_guest_measured if {
	some key
	some reference in data.broker.kbs_guests[key]
	kbs.measured(reference)
}

reasons contains "KBS guest: debug, or evidence the broker did not verify" if {
	kbs.guest
	not kbs.production
}

reasons contains msg if {
	kbs.production
	not kbs_guest_measured
	msg := sprintf("KBS guest (%v) with these measurements is not allowed for any key", [input.tee.technology])
}

reasons contains msg if {
	kbs.production
	not kbs_guest_known
	some key
	some reference in data.broker.kbs_guests[key]
	kbs.measured(reference)
	not kbs.tcb_acceptable(reference)
	msg := kbs.tcb_refusal(reference)
}

reasons contains msg if {
	kbs.guest
	some key
	some reference in data.broker.kbs_guests[key]
	not kbs.reference_valid(reference)
	msg := sprintf("key %v: a kbs_guests reference is not an object of technology, non-empty measurements and optionally tcb_statuses, snp_min_tcb: it matches nothing", [key])
}
