"""Every decision the broker makes on a runner's request: one kernel, one plan per path.

* ``kernel.py`` — the kernel: shield, parse, decide, one total record, durable append,
  metrics, answer (the broker's central promise, written once);
* ``policy.py`` — policy evaluation as every plan does it (canonical input, digest, engine,
  masked input in the record);
* ``wrapping.py`` — the steps every release shares (request facts, the DEK wrapped to a key);
* ``release.py`` — the full-evidence release plan (``POST /v1/release``);
* ``attest.py`` — the attestation plan (``POST /v1/attest``: an EAR bound to the runner's keys);
* ``attested_request.py``, ``attested_release.py`` — the release on an attestation result
  (``POST /v1/release`` with ``Authorization: DPoP``);
* ``results.py`` — issued attestation results: status, revocation, re-decision;
* ``redecide.py`` — re-deciding issued results when the policy changes.

A new decision path adds a plan (a ``kernel.Plan``), never a copy of the kernel's steps.
"""
