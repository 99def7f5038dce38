# Default release policy: data.broker.release.allow / data.broker.release.reasons.
#
# Every condition is a positive rule; `allow` needs all of them, so an input that lacks a field
# (or a typo in a field name) can only deny. `reasons` names each condition that failed.
package broker.release

import rego.v1

default allow := false

allow if {
	confidential_space
	production_image
	hardware_tee
	image_allowed
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
	data.broker.required_support in input.tee.software.support
}

hardware_tee if input.tee.technology in data.broker.hardware_tees

# The workload's image digest is on the allow-list of the requested key.
image_allowed if input.tee.workload.image_digest in data.broker.images[input.request.key]

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
	not image_allowed
	msg := sprintf("image %s is not allowed for key %s", [
		input.tee.workload.image_digest,
		input.request.key,
	])
}
