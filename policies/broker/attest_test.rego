package broker.attest_test

import rego.v1

import data.broker.attest

digest := "sha256:1111111111111111111111111111111111111111111111111111111111111111"

images := {"models/llama": [digest]}

good := {
	"schema": "broker.input/v1",
	"request": {"kind": "attest", "runner_key_thumbprint": "enc", "pop_key_thumbprint": "pop"},
	"tee": {
		"verifier": "gca",
		"technology": "tdx",
		"debug": false,
		"secure_boot": true,
		"software": {"name": "CONFIDENTIAL_SPACE", "version": "250301", "support": ["STABLE", "LATEST"]},
		"workload": {"image_digest": digest},
	},
}

test_a_production_image_some_key_allows_gets_a_result if {
	attest.allow with input as good with data.broker.images as images
	count(attest.reasons) == 0 with input as good with data.broker.images as images
}

test_an_image_no_key_allows_gets_none if {
	not attest.allow with input as good with data.broker.images as {"models/llama": ["sha256:22"]}
	some reason in attest.reasons with input as good with data.broker.images as {}
	endswith(reason, "is not allowed for any key")
}

test_a_debug_image_gets_none if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/debug", "value": true}])
	not attest.allow with input as bad with data.broker.images as images
	"debug image: a production Confidential Space image is required" in attest.reasons with input as bad
		with data.broker.images as images
}

test_a_missing_field_denies if {
	bad := json.patch(good, [{"op": "remove", "path": "/tee/secure_boot"}])
	not attest.allow with input as bad with data.broker.images as images
}
