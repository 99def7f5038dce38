package broker.release_test

import rego.v1

import data.broker.release

digest := "sha256:1111111111111111111111111111111111111111111111111111111111111111"

images := {"models/llama": [digest]}

good := {
	"schema": "broker.input/v1",
	"request": {"key": "models/llama", "version": 1, "purpose": "model-weights"},
	"tee": {
		"verifier": "gca",
		"technology": "tdx",
		"debug": false,
		"secure_boot": true,
		"software": {"name": "CONFIDENTIAL_SPACE", "version": "250301", "support": ["STABLE", "LATEST"]},
		"workload": {"image_digest": digest},
	},
}

test_production_image_with_allowed_digest_is_released if {
	release.allow with input as good with data.broker.images as images
	count(release.reasons) == 0 with input as good with data.broker.images as images
}

test_debug_image_denied if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/debug", "value": true}])
	not release.allow with input as bad with data.broker.images as images
	"debug image: a production Confidential Space image is required" in release.reasons with input as bad
		with data.broker.images as images
}

test_unlisted_digest_denied if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/workload/image_digest", "value": "sha256:22"}])
	not release.allow with input as bad with data.broker.images as images
	some reason in release.reasons with input as bad with data.broker.images as images
	startswith(reason, "image sha256:22 is not allowed")
}

test_digest_allowed_for_another_key_denied if {
	other := json.patch(good, [{"op": "replace", "path": "/request/key", "value": "models/other"}])
	not release.allow with input as other with data.broker.images as images
}

test_empty_allow_list_denies_everything if {
	not release.allow with input as good with data.broker.images as {}
}

test_missing_support_attributes_denied if {
	bad := json.remove(good, ["/tee/software/support"])
	not release.allow with input as bad with data.broker.images as images
}

test_usable_only_image_denied if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/software/support", "value": ["USABLE"]}])
	not release.allow with input as bad with data.broker.images as images
}

test_shielded_vm_is_not_a_hardware_tee if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/technology", "value": "none"}])
	not release.allow with input as bad with data.broker.images as images
	"technology 'none' is not an allowed hardware TEE" in release.reasons with input as bad
		with data.broker.images as images
}

test_secure_boot_off_denied if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/secure_boot", "value": false}])
	not release.allow with input as bad with data.broker.images as images
}

test_other_verifier_denied if {
	bad := json.patch(good, [{"op": "replace", "path": "/tee/verifier", "value": "ita"}])
	not release.allow with input as bad with data.broker.images as images
}

test_missing_debug_field_denied if {
	bad := json.remove(good, ["/tee/debug"])
	not release.allow with input as bad with data.broker.images as images
}

test_empty_input_denied if {
	not release.allow with input as {} with data.broker.images as images
}

gpu := {
	"id": "GPU-0", "verifier": "nras", "arch": "HOPPER", "cc_mode": "on", "debug": false,
	"measurements": "match", "cert_chain": "valid", "ocsp": "good", "driver_version": "550.90.07",
}

gpu_keys := {"models/llama": {"min_gpus": 1, "min_driver": "550.54"}}

with_gpus(gpus) := json.patch(good, [{"op": "add", "path": "/gpus", "value": gpus}])

test_gpu_key_released_with_a_good_gpu if {
	release.allow with input as with_gpus([gpu]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
}

test_gpu_key_denied_without_gpus if {
	not release.allow with input as with_gpus([]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
	"key models/llama needs at least 1 attested GPU(s), got 0" in release.reasons with input as with_gpus([])
		with data.broker.images as images with data.broker.gpu_keys as gpu_keys
}

test_gpu_measurement_mismatch_denied if {
	bad := json.patch(gpu, [{"op": "replace", "path": "/measurements", "value": "mismatch"}])
	not release.allow with input as with_gpus([gpu, bad]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
	"GPU GPU-0: measurements mismatch" in release.reasons with input as with_gpus([bad])
		with data.broker.images as images with data.broker.gpu_keys as gpu_keys
}

test_gpu_cc_off_or_unknown_denied if {
	off := json.patch(gpu, [{"op": "replace", "path": "/cc_mode", "value": "unknown"}])
	not release.allow with input as with_gpus([off]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
}

test_gpu_old_driver_denied if {
	old := json.patch(gpu, [{"op": "replace", "path": "/driver_version", "value": "535.104.05"}])
	not release.allow with input as with_gpus([old]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
}

test_gpu_revoked_denied if {
	revoked := json.patch(gpu, [{"op": "replace", "path": "/ocsp", "value": "revoked"}])
	not release.allow with input as with_gpus([revoked]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
}

test_gpu_ocsp_unknown_denied_by_default if {
	unknown := json.patch(gpu, [{"op": "replace", "path": "/ocsp", "value": "unknown"}])
	not release.allow with input as with_gpus([unknown]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
	"GPU GPU-0: device certificate status unknown" in release.reasons with input as with_gpus([unknown])
		with data.broker.images as images with data.broker.gpu_keys as gpu_keys
}

test_gpu_ocsp_unknown_tolerated_when_the_key_opts_in if {
	unknown := json.patch(gpu, [{"op": "replace", "path": "/ocsp", "value": "unknown"}])
	lenient := {"models/llama": {"min_gpus": 1, "min_driver": "550.54", "ocsp_unknown_ok": true}}
	release.allow with input as with_gpus([unknown]) with data.broker.images as images
		with data.broker.gpu_keys as lenient
}

test_unverified_measurements_denied if {
	unverified := json.patch(gpu, [{"op": "replace", "path": "/measurements", "value": "unverified"}])
	not release.allow with input as with_gpus([unverified]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
}

test_keys_without_gpu_policy_ignore_gpus if {
	release.allow with input as with_gpus([]) with data.broker.images as images
}

test_gpus_in_mixed_modes_denied if {
	spt := json.patch(gpu, [{"op": "add", "path": "/mode", "value": "spt"}])
	ppcie := json.patch(gpu, [{"op": "add", "path": "/mode", "value": "ppcie"}])
	release.allow with input as with_gpus([spt, spt]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
	not release.allow with input as with_gpus([spt, ppcie]) with data.broker.images as images
		with data.broker.gpu_keys as gpu_keys
	"GPUs run in mixed modes (ppcie, spt); one mode is required" in release.reasons with input as with_gpus([spt, ppcie])
		with data.broker.images as images with data.broker.gpu_keys as gpu_keys
}

requirements := {"models/llama": {
	"image_signers": ["signer-1"],
	"projects": ["prod-project"],
	"zones": ["us-central1-a"],
	"restart_policy": "Never",
	"env": {"MODE": "prod"},
	"args": ["/runner"],
}}

cs_good := json.patch(good, [
	{"op": "add", "path": "/tee/workload/signatures", "value": [{"key_id": "signer-1", "algorithm": "ECDSA_P256_SHA256"}]},
	{"op": "add", "path": "/tee/workload/restart_policy", "value": "Never"},
	{"op": "add", "path": "/tee/workload/env", "value": {"MODE": "prod", "HOME": "/"}},
	{"op": "add", "path": "/tee/workload/args", "value": ["/runner"]},
	{"op": "add", "path": "/tee/platform", "value": {"project_id": "prod-project", "zone": "us-central1-a"}},
])

test_key_requirements_met_allows if {
	release.allow with input as cs_good with data.broker.images as images
		with data.broker.key_requirements as requirements
}

test_each_key_requirement_denies_with_its_reason if {
	cases := {
		"image_signers": {"op": "replace", "path": "/tee/workload/signatures", "value": [{"key_id": "other"}]},
		"projects": {"op": "replace", "path": "/tee/platform/project_id", "value": "dev-project"},
		"zones": {"op": "replace", "path": "/tee/platform/zone", "value": "europe-west4-a"},
		"restart_policy": {"op": "replace", "path": "/tee/workload/restart_policy", "value": "Always"},
		"env": {"op": "replace", "path": "/tee/workload/env/MODE", "value": "debug"},
		"args": {"op": "replace", "path": "/tee/workload/args", "value": ["/runner", "--debug"]},
	}
	every name, patch in cases {
		changed := json.patch(cs_good, [patch])
		not release.allow with input as changed with data.broker.images as images
			with data.broker.key_requirements as requirements
		concat("", ["key models/llama requires ", name]) in release.reasons with input as changed
			with data.broker.images as images with data.broker.key_requirements as requirements
	}
}

test_missing_claims_fail_requirements if {
	changed := json.patch(cs_good, [{"op": "remove", "path": "/tee/workload/signatures"}])
	not release.allow with input as changed with data.broker.images as images
		with data.broker.key_requirements as requirements
}

# A missing field fails its requirement, with its reason (OPA evaluates `x` of `not x in y` outside
# the `not`: written that way, a missing project or zone passed).
test_missing_platform_fields_fail_their_requirements if {
	every name, path in {"projects": "/tee/platform/project_id", "zones": "/tee/platform/zone"} {
		changed := json.remove(cs_good, [path])
		not release.allow with input as changed with data.broker.images as images
			with data.broker.key_requirements as requirements
		concat("", ["key models/llama requires ", name]) in release.reasons with input as changed
			with data.broker.images as images with data.broker.key_requirements as requirements
	}
	no_platform := json.remove(cs_good, ["/tee/platform"])
	not release.allow with input as no_platform with data.broker.images as images
		with data.broker.key_requirements as requirements
}

test_missing_support_attributes_say_why if {
	bad := json.remove(good, ["/tee/software/support"])
	"image lacks the STABLE support attribute" in release.reasons with input as bad with data.broker.images as images
}

key_policy := {"only_prod": {
	"applies_to": {"models/"},
	"deny": {"nope"},
}}

test_key_policy_narrows_only_its_keys if {
	not release.allow with input as good with data.broker.images as images
		with data.broker.key_policies as key_policy
	"nope" in release.reasons with input as good with data.broker.images as images
		with data.broker.key_policies as key_policy
	other := json.patch(good, [{"op": "replace", "path": "/request/key", "value": "tools/x"}])
	release.allow with input as other with data.broker.images as {"tools/x": [digest]}
		with data.broker.key_policies as key_policy
}

test_malformed_driver_versions_denied if {
	every version in {" 550.90", "550_1", "550.90.07 ", "1e3", "0x226", "550.90.07.01", "５５０", ""} {
		bad := json.patch(gpu, [{"op": "replace", "path": "/driver_version", "value": version}])
		not release.allow with input as with_gpus([bad]) with data.broker.images as images
			with data.broker.gpu_keys as gpu_keys
	}
}

# --- KBS guests (docs/kbs.md) ------------------------------------------------------------------

kbs_guest := {
	"schema": "broker.input/v1",
	"request": {"key": "models/llama", "version": 1, "purpose": "model-weights", "attestation": {"jti": "j"}},
	"tee": {"verifier": "local", "technology": "sample", "debug": false, "measurements": {"svn": "1"}},
	"gpus": [],
	"claims": {"kbs": {"protocol": "0.4.0", "tee": "sample"}, "sample": {"svn": "1"}},
}

kbs_guests := {"models/llama": [{"technology": "sample", "measurements": {"svn": "1"}}]}

test_kbs_guest_released_a_key_that_knows_it if {
	release.allow with input as kbs_guest with data.broker.kbs_guests as kbs_guests
	count(release.reasons) == 0 with input as kbs_guest with data.broker.kbs_guests as kbs_guests
}

test_kbs_guest_denied_a_key_that_does_not_know_it if {
	other := {"models/other": [{"technology": "sample", "measurements": {"svn": "1"}}]}
	not release.allow with input as kbs_guest with data.broker.kbs_guests as other
	"KBS guest (sample) with these measurements is not allowed for key models/llama" in release.reasons with input as kbs_guest
		with data.broker.kbs_guests as other
}

test_kbs_guest_denied_on_a_measurement_mismatch if {
	pinned := {"models/llama": [{"technology": "sample", "measurements": {"svn": "2"}}]}
	not release.allow with input as kbs_guest with data.broker.kbs_guests as pinned
}

# A reference without measurements would match every guest of its technology: it matches none.
test_kbs_reference_without_measurements_matches_nothing if {
	malformed := [
		{"technology": "sample"},
		{"technology": "sample", "measurements": {}},
		{"technology": "sample", "measurements": []},
		{"technology": "sample", "measurements": "svn"},
		{"technology": "sample", "measurement": {"svn": "1"}}, # a typo
		{"technology": "sample", "measurements": {"svn": "1"}, "tcb_status": ["OutOfDate"]}, # another
		{"measurements": {"svn": "1"}},
		"sample",
	]
	every reference in malformed {
		guests := {"models/llama": [reference]}
		not release.allow with input as kbs_guest with data.broker.kbs_guests as guests
		"key models/llama: a kbs_guests reference is not an object of technology, non-empty measurements and optionally tcb_statuses, snp_min_tcb: it matches nothing" in release.reasons with input as kbs_guest
			with data.broker.kbs_guests as guests
	}
}

test_kbs_guest_denied_a_gpu_key if {
	not release.allow with input as kbs_guest with data.broker.kbs_guests as kbs_guests
		with data.broker.gpu_keys as {"models/llama": {"min_gpus": 1, "min_driver": "550.0"}}
}

test_kbs_guest_denied_a_key_with_confidential_space_requirements if {
	not release.allow with input as kbs_guest with data.broker.kbs_guests as kbs_guests
		with data.broker.key_requirements as {"models/llama": {"projects": ["p"]}}
}

test_kbs_guest_with_an_image_digest_is_still_no_confidential_space_runner if {
	spoof := json.patch(kbs_guest, [{"op": "add", "path": "/tee/workload", "value": {"image_digest": digest}}])
	not release.allow with input as spoof with data.broker.images as images
}

test_kbs_guest_without_a_key_in_its_request_denied if {
	keyless := json.remove(kbs_guest, ["/request/key"])
	not release.allow with input as keyless with data.broker.kbs_guests as kbs_guests
}

# TDX: Intel's TCB status for the platform, from the collateral (the review's OutOfDate input).
kbs_tdx := {
	"schema": "broker.input/v1",
	"request": {"key": "models/llama", "version": 1, "purpose": "model-weights", "attestation": {"jti": "j"}},
	"tee": {
		"verifier": "local", "technology": "tdx", "debug": false, "secure_boot": false,
		"measurements": {"mrtd": "aa", "rtmr": ["00", "11", "22", "33"], "mrconfigid": "cc"},
		"tcb_status": "UpToDate", "advisory_ids": [],
	},
	"gpus": [],
	"claims": {"kbs": {"protocol": "0.4.0", "tee": "tdx", "init_data": null}},
}

tdx_guests := {"models/llama": [{"technology": "tdx", "measurements": {"mrtd": "aa", "mrconfigid": "cc"}}]}

out_of_date := json.patch(kbs_tdx, [
	{"op": "replace", "path": "/tee/tcb_status", "value": "OutOfDate"},
	{"op": "replace", "path": "/tee/advisory_ids", "value": ["INTEL-SA-00837"]},
])

test_kbs_tdx_guest_up_to_date_released if {
	release.allow with input as kbs_tdx with data.broker.kbs_guests as tdx_guests
	count(release.reasons) == 0 with input as kbs_tdx with data.broker.kbs_guests as tdx_guests
}

test_kbs_tdx_guest_out_of_date_denied if {
	not release.allow with input as out_of_date with data.broker.kbs_guests as tdx_guests
	"KBS guest (tdx): Intel rates the platform's TCB OutOfDate; accepted: [\"UpToDate\"]" in release.reasons with input as out_of_date
		with data.broker.kbs_guests as tdx_guests
}

test_kbs_tdx_guest_without_a_tcb_status_denied if {
	missing := json.remove(kbs_tdx, ["/tee/tcb_status"])
	not release.allow with input as missing with data.broker.kbs_guests as tdx_guests
	"KBS guest (tdx): Intel rates the platform's TCB null; accepted: [\"UpToDate\"]" in release.reasons with input as missing
		with data.broker.kbs_guests as tdx_guests
}

test_kbs_tdx_statuses_from_the_data_or_the_reference if {
	release.allow with input as out_of_date with data.broker.kbs_guests as tdx_guests
		with data.broker.kbs_tcb_statuses as ["UpToDate", "OutOfDate"]
	lenient := {"models/llama": [object.union(tdx_guests["models/llama"][0], {"tcb_statuses": ["OutOfDate"]})]}
	release.allow with input as out_of_date with data.broker.kbs_guests as lenient
	not release.allow with input as kbs_tdx with data.broker.kbs_guests as lenient # its list, only
}

test_kbs_tdx_guest_denied_without_accepted_statuses_in_the_data if {
	not release.allow with input as kbs_tdx with data.broker.kbs_guests as tdx_guests
		with data.broker.kbs_tcb_statuses as []
}

# SEV-SNP: REPORTED_TCB against a minimum per product (the shipped data: Milan only).
kbs_snp := {
	"schema": "broker.input/v1",
	"request": {"key": "models/llama", "version": 1, "purpose": "model-weights", "attestation": {"jti": "j"}},
	"tee": {
		"verifier": "local", "technology": "sev-snp", "debug": false, "product": "Milan",
		"measurements": {"measurement": "aa", "host_data": "cc"},
		"tcb": {"bootloader": 4, "tee": 0, "snp": 22, "microcode": 219, "fmc": null},
		"tcb_status": "",
	},
	"gpus": [],
	"claims": {"kbs": {"protocol": "0.4.0", "tee": "snp", "init_data": null}},
}

snp_guests := {"models/llama": [{"technology": "sev-snp", "measurements": {"measurement": "aa"}}]}

test_kbs_snp_guest_at_the_minimum_released if {
	release.allow with input as kbs_snp with data.broker.kbs_guests as snp_guests
	count(release.reasons) == 0 with input as kbs_snp with data.broker.kbs_guests as snp_guests
}

test_kbs_snp_guest_below_the_minimum_denied if {
	every name in {"bootloader", "tee", "snp", "microcode"} {
		below := json.patch(kbs_snp, [{"op": "replace", "path": concat("/", ["/tee/tcb", name]), "value": kbs_snp.tee.tcb[name] - 1}])
		not release.allow with input as below with data.broker.kbs_guests as snp_guests
			with data.broker.kbs_snp_min_tcb as {"Milan": {"bootloader": 4, "tee": 1, "snp": 22, "microcode": 219}}
	}
	old := json.patch(kbs_snp, [{"op": "replace", "path": "/tee/tcb", "value": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115, "fmc": null}}])
	not release.allow with input as old with data.broker.kbs_guests as snp_guests
	"KBS guest (sev-snp, Milan): reported TCB {\"bootloader\": 3, \"fmc\": null, \"microcode\": 115, \"snp\": 8, \"tee\": 0} is below the minimum {\"bootloader\": 4, \"microcode\": 219, \"snp\": 22, \"tee\": 0}" in release.reasons with input as old
		with data.broker.kbs_guests as snp_guests
}

test_kbs_snp_guest_without_its_tcb_or_product_denied if {
	every path in ["/tee/tcb", "/tee/tcb/microcode", "/tee/product"] {
		missing := json.remove(kbs_snp, [path])
		not release.allow with input as missing with data.broker.kbs_guests as snp_guests
	}
}

test_kbs_snp_product_without_a_minimum_denied if {
	genoa := json.patch(kbs_snp, [{"op": "replace", "path": "/tee/product", "value": "Genoa"}])
	not release.allow with input as genoa with data.broker.kbs_guests as snp_guests
	"KBS guest (sev-snp, Genoa): reported TCB {\"bootloader\": 4, \"fmc\": null, \"microcode\": 219, \"snp\": 22, \"tee\": 0} is below the minimum null" in release.reasons with input as genoa
		with data.broker.kbs_guests as snp_guests
}

test_kbs_snp_minimum_from_the_reference if {
	old := json.patch(kbs_snp, [{"op": "replace", "path": "/tee/tcb", "value": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115, "fmc": null}}])
	lenient := {"models/llama": [object.union(snp_guests["models/llama"][0], {"snp_min_tcb": {"bootloader": 3, "tee": 0, "snp": 8, "microcode": 115}})]}
	release.allow with input as old with data.broker.kbs_guests as lenient
	partial := {"models/llama": [object.union(snp_guests["models/llama"][0], {"snp_min_tcb": {"bootloader": 3}})]}
	not release.allow with input as old with data.broker.kbs_guests as partial # every SPL named
}

test_kbs_snp_turin_minimum_names_its_fmc if {
	turin := json.patch(kbs_snp, [
		{"op": "replace", "path": "/tee/product", "value": "Turin"},
		{"op": "replace", "path": "/tee/tcb/fmc", "value": 1},
	])
	four := {"Turin": {"bootloader": 1, "tee": 0, "snp": 1, "microcode": 1}}
	not release.allow with input as turin with data.broker.kbs_guests as snp_guests with data.broker.kbs_snp_min_tcb as four
	release.allow with input as turin with data.broker.kbs_guests as snp_guests
		with data.broker.kbs_snp_min_tcb as {"Turin": object.union(four.Turin, {"fmc": 1})}
}
