package broker.identity_test

import rego.v1

import data.broker.identity

digest := "sha256:1111111111111111111111111111111111111111111111111111111111111111"

identities := {digest: "shards/llama"}

good := {
	"schema": "broker.input/v1",
	"request": {"kind": "identity", "trust_domain": "example.org"},
	"tee": {
		"verifier": "gca",
		"technology": "tdx",
		"debug": false,
		"secure_boot": true,
		"software": {"name": "CONFIDENTIAL_SPACE", "version": "250301", "support": ["STABLE"]},
		"workload": {"image_digest": digest},
	},
}

test_a_mapped_image_gets_its_path if {
	identity.allow with input as good with data.broker.identities as identities
	identity.spiffe_path == "shards/llama" with input as good with data.broker.identities as identities
	count(identity.reasons) == 0 with input as good with data.broker.identities as identities
}

test_an_unmapped_image_gets_none if {
	not identity.allow with input as good with data.broker.identities as {}
	not identity.spiffe_path with input as good with data.broker.identities as {}
	some reason in identity.reasons with input as good with data.broker.identities as {}
	endswith(reason, "has no workload identity")
}

test_a_debug_image_gets_none if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/debug", "value": true}])
	not identity.allow with input as bad with data.broker.identities as identities
}

test_a_missing_field_denies if {
	bad := json.patch(good, [{"op": "remove", "path": "/tee/secure_boot"}])
	not identity.allow with input as bad with data.broker.identities as identities
}

test_the_default_data_maps_nothing if {
	not identity.allow with input as good
}
