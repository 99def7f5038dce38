# Worked example (docs/policy.md): models/mistral only for one image, only with a GPU in
# confidential-computing mode, only from project prod-project.
#
# A per-key policy can only add reasons to `deny` for the keys in `applies_to`: the shipped
# release policy refuses a key while any applicable policy denies it, and nothing here can make
# it allow. Write each condition positively (`image_ok`) and deny when it does not hold, so a
# missing or malformed claim denies instead of silently passing.
package broker.key_policies.mistral

import rego.v1

applies_to := {"models/mistral"}

allowed_image := "sha256:abababababababababababababababababababababababababababababababab"

image_ok if input.tee.workload.image_digest == allowed_image

gpu_in_cc_mode if {
	some gpu in input.gpus
	gpu.cc_mode == "on"
}

project_ok if input.tee.platform.project_id == "prod-project"

deny contains "models/mistral: only the approved image may receive this key" if not image_ok

deny contains "models/mistral: needs a GPU in confidential-computing mode" if not gpu_in_cc_mode

deny contains "models/mistral: only workloads in project prod-project" if not project_ok
