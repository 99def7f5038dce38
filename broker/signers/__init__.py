"""Every signing key the broker serves with, by what it signs: checkpoints of the log
(``checkpoint*.py``) and attestation results (``results*.py``); local PEM files, Cloud KMS
or PKCS#11."""
