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

# --- KBS guests (docs/kbs.md) ------------------------------------------------------------------

kbs_guest := {
	"schema": "broker.input/v1",
	"request": {"kind": "attest", "runner_key_thumbprint": "tee"},
	"tee": {"verifier": "local", "technology": "tdx", "debug": false, "measurements": {"mrtd": "aa", "rtmr": ["00"]}, "tcb_status": "UpToDate"},
	"gpus": [],
	"claims": {"kbs": {"protocol": "0.4.0", "tee": "tdx"}},
}

kbs_guests := {"models/llama": [{"technology": "tdx", "measurements": {"mrtd": "aa"}}]}

test_a_kbs_guest_some_key_knows_gets_a_result if {
	attest.allow with input as kbs_guest with data.broker.kbs_guests as kbs_guests
	count(attest.reasons) == 0 with input as kbs_guest with data.broker.kbs_guests as kbs_guests
}

test_a_kbs_guest_with_other_measurements_gets_none if {
	other := {"models/llama": [{"technology": "tdx", "measurements": {"mrtd": "bb"}}]}
	not attest.allow with input as kbs_guest with data.broker.kbs_guests as other
	"KBS guest (tdx) with these measurements is not allowed for any key" in attest.reasons with input as kbs_guest
		with data.broker.kbs_guests as other
}

test_a_kbs_guest_of_another_technology_gets_none if {
	snp := json.patch(kbs_guest, [{"op": "replace", "path": "/tee/technology", "value": "sev-snp"}])
	not attest.allow with input as snp with data.broker.kbs_guests as kbs_guests
}

test_a_debug_kbs_guest_gets_none if {
	debug := json.patch(kbs_guest, [{"op": "replace", "path": "/tee/debug", "value": true}])
	not attest.allow with input as debug with data.broker.kbs_guests as kbs_guests
	"KBS guest: debug, or evidence the broker did not verify" in attest.reasons with input as debug
		with data.broker.kbs_guests as kbs_guests
}

test_a_kbs_guest_without_data_gets_none if {
	not attest.allow with input as kbs_guest
}

test_a_token_verifier_is_no_kbs_guest if {
	gca := json.patch(kbs_guest, [{"op": "replace", "path": "/tee/verifier", "value": "gca"}])
	not attest.allow with input as gca with data.broker.kbs_guests as kbs_guests
}

test_an_out_of_date_kbs_guest_gets_none if {
	stale := json.patch(kbs_guest, [{"op": "replace", "path": "/tee/tcb_status", "value": "OutOfDate"}])
	not attest.allow with input as stale with data.broker.kbs_guests as kbs_guests
	"KBS guest (tdx): Intel rates the platform's TCB OutOfDate; accepted: [\"UpToDate\"]" in attest.reasons with input as stale
		with data.broker.kbs_guests as kbs_guests
	missing := json.remove(kbs_guest, ["/tee/tcb_status"])
	not attest.allow with input as missing with data.broker.kbs_guests as kbs_guests
}

test_a_kbs_guest_below_the_snp_minimum_gets_none if {
	snp := json.patch(kbs_guest, [
		{"op": "replace", "path": "/tee/technology", "value": "sev-snp"},
		{"op": "add", "path": "/tee/product", "value": "Milan"},
		{"op": "add", "path": "/tee/tcb", "value": {"bootloader": 4, "tee": 0, "snp": 22, "microcode": 219, "fmc": null}},
	])
	guests := {"models/llama": [{"technology": "sev-snp", "measurements": {"mrtd": "aa"}}]}
	attest.allow with input as snp with data.broker.kbs_guests as guests
	old := json.patch(snp, [{"op": "replace", "path": "/tee/tcb/snp", "value": 21}])
	not attest.allow with input as old with data.broker.kbs_guests as guests
}

test_a_reference_without_measurements_knows_no_guest if {
	every reference in [{"technology": "tdx"}, {"technology": "tdx", "measurements": {}}, {"technology": "tdx", "measurement": {"mrtd": "aa"}}] {
		guests := {"models/llama": [reference]}
		not attest.allow with input as kbs_guest with data.broker.kbs_guests as guests
		"key models/llama: a kbs_guests reference is not an object of technology, non-empty measurements and optionally tcb_statuses, snp_min_tcb: it matches nothing" in attest.reasons with input as kbs_guest
			with data.broker.kbs_guests as guests
	}
}
