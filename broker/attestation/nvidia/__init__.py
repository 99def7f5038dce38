"""NVIDIA GPU evidence: NRAS detached EAT tokens (``nras.py``) and raw SPDM evidence verified
locally (``spdm.py``, ``rim.py``, ``local.py``). Both produce the same normalised ``gpus[]``
entries (``claims.gpu_entry``) so a policy does not need to know which path verified a GPU."""
