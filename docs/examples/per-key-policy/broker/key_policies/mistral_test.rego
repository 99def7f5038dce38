# Tests live outside package broker.key_policies: the release policy reads every package there.
package broker.key_policy_tests.mistral

import rego.v1

import data.broker.release

digest := "sha256:abababababababababababababababababababababababababababababababab"

good := {
	"schema": "broker.input/v1",
	"request": {"key": "models/mistral", "version": 1, "purpose": "model-weights"},
	"tee": {
		"verifier": "gca",
		"technology": "tdx",
		"debug": false,
		"secure_boot": true,
		"software": {"name": "CONFIDENTIAL_SPACE", "version": "250301", "support": ["STABLE"]},
		"workload": {"image_digest": digest},
		"platform": {"project_id": "prod-project", "zone": "us-central1-a"},
	},
	"gpus": [{"id": "GPU-0", "cc_mode": "on"}],
}

images := {"models/mistral": [digest], "models/llama": [digest]}

test_mistral_allowed_when_every_condition_holds if {
	release.allow with input as good with data.broker.images as images
}

test_mistral_denied_for_another_project if {
	other := json.patch(good, [{"op": "replace", "path": "/tee/platform/project_id", "value": "dev"}])
	not release.allow with input as other with data.broker.images as images
	"models/mistral: only workloads in project prod-project" in release.reasons with input as other
		with data.broker.images as images
}

test_mistral_denied_without_a_cc_gpu if {
	no_gpu := json.patch(good, [{"op": "replace", "path": "/gpus", "value": []}])
	not release.allow with input as no_gpu with data.broker.images as images
}

test_mistral_denied_for_another_image_even_if_allow_listed if {
	other := json.patch(good, [{"op": "replace", "path": "/tee/workload/image_digest", "value": "sha256:00"}])
	not release.allow with input as other with data.broker.images as {"models/mistral": ["sha256:00"]}
}

test_other_keys_are_not_narrowed if {
	llama := json.patch(good, [
		{"op": "replace", "path": "/request/key", "value": "models/llama"},
		{"op": "replace", "path": "/tee/platform/project_id", "value": "dev"},
	])
	release.allow with input as llama with data.broker.images as images
}
