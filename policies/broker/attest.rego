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

reasons contains "evidence is not a Confidential Space attestation" if not confidential_space

reasons contains "debug image: a production Confidential Space image is required" if {
	input.tee.debug != false
}

reasons contains "secure boot is not on" if not input.tee.secure_boot == true

reasons contains msg if {
	not data.broker.required_support in input.tee.software.support
	msg := sprintf("image lacks the %s support attribute", [data.broker.required_support])
}

reasons contains msg if {
	not hardware_tee
	msg := sprintf("technology '%v' is not an allowed hardware TEE", [input.tee.technology])
}

reasons contains msg if {
	not image_known
	msg := sprintf("image %s is not allowed for any key", [input.tee.workload.image_digest])
}
