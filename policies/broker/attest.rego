# Default attestation policy: data.broker.attest.allow / data.broker.attest.reasons.
#
# POST /v1/attest asks it (input.request.kind == "attest") before an attestation result (EAR)
# is signed; every key released on that result is then decided again by data.broker.release
# for that key. So this policy says what a runner must be to hold a result at all; the per-key
# allow-lists stay in the release policy. Positive rules only: a missing field denies.
package broker.attest

import rego.v1

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
	kbs_guest_production
	some key
	kbs_reference_matches(data.broker.kbs_guests[key])
}

confidential_space if {
	input.tee.verifier == "gca"
	input.tee.software.name == "CONFIDENTIAL_SPACE"
}

production_image if {
	input.tee.debug == false
	input.tee.secure_boot == true
	data.broker.required_support in input.tee.software.support
}

hardware_tee if input.tee.technology in data.broker.hardware_tees

# The image is on the allow-list of at least one key: an image no key allows gets no result.
image_known if {
	some key
	input.tee.workload.image_digest in data.broker.images[key]
}

reasons contains "evidence is not a Confidential Space attestation" if {
	not kbs_guest
	not confidential_space
}

reasons contains "debug image: a production Confidential Space image is required" if {
	not kbs_guest
	input.tee.debug != false
}

reasons contains "secure boot is not on" if {
	not kbs_guest
	not input.tee.secure_boot == true
}

reasons contains msg if {
	not kbs_guest
	not data.broker.required_support in input.tee.software.support
	msg := sprintf("image lacks the %s support attribute", [data.broker.required_support])
}

reasons contains msg if {
	not kbs_guest
	not hardware_tee
	msg := sprintf("technology '%v' is not an allowed hardware TEE", [input.tee.technology])
}

reasons contains msg if {
	not kbs_guest
	not image_known
	msg := sprintf("image %s is not allowed for any key", [input.tee.workload.image_digest])
}

# --- Confidential Containers guests (the KBS facade, docs/kbs.md) -------------------------------
# Raw evidence the broker verified itself (tee.verifier "local": a TDX quote, an SEV-SNP report,
# or the development-only sample), not debug, whose technology and measurements match one of a
# key's references in data.broker.kbs_guests: {"<key>": [{"technology": "tdx", "measurements":
# {"mrtd": "…"}}, …]}; every member of a reference's measurements must equal the evidence's (an
# empty object matches any evidence of that technology). The same rules are in release.rego.
kbs_guest if input.claims.kbs.protocol

kbs_guest_production if {
	kbs_guest
	input.tee.verifier == "local"
	input.tee.debug == false
}

kbs_reference_matches(references) if {
	some reference in references
	reference.technology == input.tee.technology
	every name, value in object.get(reference, "measurements", {}) {
		input.tee.measurements[name] == value
	}
}

reasons contains "KBS guest: debug, or evidence the broker did not verify" if {
	kbs_guest
	not kbs_guest_production
}

reasons contains msg if {
	kbs_guest_production
	not kbs_guest_known
	msg := sprintf("KBS guest (%v) with these measurements is not allowed for any key", [input.tee.technology])
}

kbs_guest_known if {
	some key
	kbs_reference_matches(data.broker.kbs_guests[key])
}
