"""Development issuers for tests, from a small pool of RSA keys made once per test process.

A new RSA-2048 key costs ~75 ms; the suite starts ~200 brokers. Each issuer still has its own
``kid``, and consecutive issuers get different keys, so "another issuer's token" stays another
key.
"""

from __future__ import annotations

import itertools
from functools import cache

from cryptography.hazmat.primitives.asymmetric import rsa

from broker.dev.issuer import DevIssuer

POOL = 8
_next = itertools.count()


@cache
def _key(index: int) -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def dev_issuer() -> DevIssuer:
    """A development issuer (dev mode on) signing with the next key of the pool."""
    return DevIssuer(dev_mode=True, key=_key(next(_next) % POOL))
