"""Where spent nonces and attestation results live, by backend (memory, SQLite, Redis,
PostgreSQL), and the stateless challenge codec (``nonces.py``, domain)."""
