# Default workload identity policy: data.broker.identity.allow / .reasons / .spiffe_path.
#
# POST /v1/identity asks it (input.request.kind == "identity") on the stored input of a live
# attestation result before a workload certificate (X.509-SVID) is issued; the certificate's one
# URI SAN is spiffe://<[identity] trust_domain>/<spiffe_path>. Deny unless data.broker.identities
# maps the attested image digest to a SPIFFE ID path. Positive rules only: a missing field denies.
package broker.identity

import rego.v1

default allow := false

allow if {
	confidential_space
	production_image
	spiffe_path
}

spiffe_path := data.broker.identities[input.tee.workload.image_digest]

confidential_space if {
	input.tee.verifier == "gca"
	input.tee.software.name == "CONFIDENTIAL_SPACE"
}

production_image if {
	input.tee.debug == false
	input.tee.secure_boot == true
}

reasons contains "evidence is not a Confidential Space attestation" if not confidential_space

reasons contains "debug image: a production Confidential Space image is required" if {
	input.tee.debug != false
}

reasons contains "secure boot is not on" if not input.tee.secure_boot == true

reasons contains msg if {
	not spiffe_path
	msg := sprintf("image %s has no workload identity", [input.tee.workload.image_digest])
}
