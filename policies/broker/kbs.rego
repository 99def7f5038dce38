# Confidential Containers guests over the KBS protocol (docs/kbs.md): the rules release.rego and
# attest.rego share, in their own package so that neither policy depends on the other (a team's
# own release.rego leaves the attestation policy working). Functions of the evidence and one
# data.broker.kbs_guests reference; which key a reference belongs to is the caller's business.
package broker.kbs

import rego.v1

# Raw evidence the broker verified itself (tee.verifier "local": a TDX quote, an SEV-SNP report,
# or the development-only sample), not debug, that matches one of data.broker.kbs_guests[<key>]'s
# references: {"technology": "tdx", "measurements": {"mrtd": "…", "mrconfigid": "…"}}, every
# listed measurement equal to the evidence's, and the platform's TCB acceptable:
#   tdx      Intel's TCB status for the platform (from the collateral) is one of the reference's
#            "tcb_statuses", else of data.broker.kbs_tcb_statuses (shipped: ["UpToDate"]);
#   sev-snp  the report's REPORTED_TCB is at least the reference's "snp_min_tcb", else
#            data.broker.kbs_snp_min_tcb[<product>] ({"bootloader", "tee", "snp", "microcode"},
#            and "fmc" on Turin); a product without a minimum gets nothing;
#   sample   nothing to judge (development only: the evidence is unsigned).
# attest.rego asks the same functions (reference_matches) whether any key knows a guest.
guest if input.claims.kbs.protocol

production if {
	guest
	input.tee.verifier == "local"
	input.tee.debug == false
}

reference_matches(reference) if {
	measured(reference)
	tcb_acceptable(reference)
}

# A reference of this guest's technology whose every measurement is the evidence's.
measured(reference) if {
	reference_valid(reference)
	reference.technology == input.tee.technology
	every name, value in reference.measurements {
		input.tee.measurements[name] == value
	}
}

# A reference is an object of exactly these members, with at least one measurement: without
# measurements (or with {} or [], or a typo such as "measurement") it would match every guest of
# its technology, so it matches nothing and says why (`broker policy check` refuses it first).
reference_members := {"technology", "measurements", "tcb_statuses", "snp_min_tcb"}

reference_valid(reference) if {
	is_object(reference)
	is_string(reference.technology)
	is_object(reference.measurements)
	count(reference.measurements) > 0
	count(object.keys(reference) - reference_members) == 0
}

tdx_statuses(reference) := reference.tcb_statuses if {
	"tcb_statuses" in object.keys(reference)
} else := data.broker.kbs_tcb_statuses

tcb_acceptable(reference) if {
	input.tee.technology == "tdx"
	input.tee.tcb_status in tdx_statuses(reference)
}

snp_minimum(reference) := reference.snp_min_tcb if {
	"snp_min_tcb" in object.keys(reference)
} else := data.broker.kbs_snp_min_tcb[input.tee.product]

# The SPLs a minimum must name (AMD 57230 Table 8): FMC only on Turin.
snp_fields := {"bootloader", "tee", "snp", "microcode", "fmc"} if input.tee.product == "Turin"

snp_fields := {"bootloader", "tee", "snp", "microcode"} if {
	is_string(input.tee.product)
	input.tee.product != "Turin"
}

tcb_acceptable(reference) if {
	input.tee.technology == "sev-snp"
	minimum := snp_minimum(reference)
	fields := snp_fields
	every name in fields {
		is_number(minimum[name])
		input.tee.tcb[name] >= minimum[name]
	}
}

tcb_acceptable(_) if input.tee.technology == "sample"

# Why a measured reference's TCB is not acceptable (attest.rego says the same); a minimum the
# data lacks reads null.
tcb_refusal(reference) := sprintf("KBS guest (tdx): Intel rates the platform's TCB %v; accepted: %v", [
	object.get(input.tee, "tcb_status", null),
	shown_statuses(reference),
]) if input.tee.technology == "tdx"

tcb_refusal(reference) := sprintf("KBS guest (sev-snp, %v): reported TCB %v is below the minimum %v", [
	object.get(input.tee, "product", null),
	object.get(input.tee, "tcb", null),
	shown_minimum(reference),
]) if input.tee.technology == "sev-snp"

shown_statuses(reference) := statuses if {
	statuses := tdx_statuses(reference)
} else := null

shown_minimum(reference) := minimum if {
	minimum := snp_minimum(reference)
} else := null
