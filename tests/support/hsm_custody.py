"""What the tests of keys on an HSM need beside the broker: work on the process's one login to
the SoftHSM2 token, an EC P-256 signing key pair made on it (result and identity CA keys), and
for DEKs in HSM custody (``x-hsm-rewrap``) the DEK read out of the token the way the broker
never does and a spy on every bytes value the broker's Python code touches."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

import pkcs11
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from pkcs11 import KeyType, Mechanism, MechanismFlag, ObjectClass
from pkcs11.util.ec import encode_ec_public_key, encode_named_curve_parameters

from broker.keys.kek.base import dek_aad
from broker.keys.kek.pkcs11 import acquire_session, parse_pkcs11_uri, release_session

T = TypeVar("T")


def on_token(kek_uri: str, work: Callable[[Any], T]) -> T:
    """``work(session)`` on the token's one logged-in session and its thread (a second login
    in this process would fail: CKR_USER_ALREADY_LOGGED_IN)."""
    uri = parse_pkcs11_uri(kek_uri)
    shared = acquire_session(uri)

    def run() -> T:
        shared.open_sync(uri)
        return work(shared.session)

    try:
        return shared.executor.submit(run).result()
    finally:
        if release_session(shared):
            shared.executor.submit(shared.close_sync).result()
            shared.executor.shutdown(wait=False)


def make_p256_key_pair(uri: str) -> ec.EllipticCurvePublicKey:
    """An EC P-256 key pair on the token under the URI's label, as an operator makes a signing
    key: the private half sensitive and never extractable. Returns the public half."""
    label = parse_pkcs11_uri(uri).object

    def make(session: Any) -> ec.EllipticCurvePublicKey:
        parameters = session.create_domain_parameters(
            KeyType.EC,
            {pkcs11.Attribute.EC_PARAMS: encode_named_curve_parameters("secp256r1")},
            local=True,
        )
        public, _ = parameters.generate_keypair(
            store=True,
            label=label,
            private_template={
                pkcs11.Attribute.SENSITIVE: True,
                pkcs11.Attribute.EXTRACTABLE: False,
            },
        )
        key = serialization.load_der_public_key(encode_ec_public_key(public))
        assert isinstance(key, ec.EllipticCurvePublicKey)
        return key

    return on_token(uri, make)


def read_out_of_the_token(kek_uri: str, name: str, version: int, wrapped: bytes) -> bytes:
    """Test only: the DEK, read with the PIN by re-deriving the documented wrapping key
    (docs/keys.md) — what the broker never does."""
    label = parse_pkcs11_uri(kek_uri).object

    def read(session: Any) -> bytes:
        kek = session.get_key(label=label, object_class=ObjectClass.SECRET_KEY)
        data = hashlib.sha256(b"broker-dek-wrap/v1\0" + dek_aad(name, version)).digest()
        wrapping = kek.derive_key(
            KeyType.AES,
            256,
            mechanism=Mechanism.AES_ECB_ENCRYPT_DATA,
            mechanism_param=data,
            capabilities=MechanismFlag.UNWRAP,
            template={pkcs11.Attribute.TOKEN: False},
        )
        dek = wrapping.unwrap_key(
            ObjectClass.SECRET_KEY,
            KeyType.AES,
            wrapped[1:],
            mechanism=Mechanism.AES_KEY_WRAP_PAD,
            template={pkcs11.Attribute.SENSITIVE: False, pkcs11.Attribute.EXTRACTABLE: True},
        )
        try:
            return bytes(dek[pkcs11.Attribute.VALUE])
        finally:
            dek.destroy()
            wrapping.destroy()

    return on_token(kek_uri, read)


def session_objects(kek_uri: str) -> int:
    """How many session (not token) objects the process's login has on the token."""
    return on_token(
        kek_uri, lambda session: len(list(session.get_objects({pkcs11.Attribute.TOKEN: False})))
    )


class PlaintextSpy:
    """Every bytes value a Python function received or returned while watching: on this thread
    outside the runner's own task (the SDK, which must see the DEK), and on the token's thread.
    A broker served in this process handles requests in other tasks and calls its PKCS#11 token
    on that thread, so whatever its Python code touches is here. (C code — SoftHSM2 itself,
    OpenSSL — is not watched.)"""

    def __init__(self) -> None:
        self.runner: asyncio.Task[Any] | None = None
        self.main = threading.get_ident()
        self.seen: list[bytes] = []
        self.threads: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        if threading.get_ident() == self.main:
            if asyncio.current_task() is self.runner:
                return
        else:
            self.threads.add(threading.current_thread().name)
        values = frame.f_locals.values() if event == "call" else (arg,)
        for value in values:
            if isinstance(value, bytes | bytearray | memoryview) and len(value) >= 32:
                self.seen.append(bytes(value))

    def saw(self, secret: bytes) -> bool:
        return any(secret in value for value in self.seen)

    @contextmanager
    def watching(self, kek_uri: str) -> Iterator[None]:
        """Watch this thread and the thread of the token ``kek_uri`` names (which a running
        broker has open: the spy installs itself there, whenever that thread started)."""
        uri = parse_pkcs11_uri(kek_uri, read_pin=lambda _: "unused")  # only the token's name
        shared = acquire_session(uri)
        self.runner = asyncio.current_task()
        shared.executor.submit(sys.setprofile, self).result()
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)
            shared.executor.submit(sys.setprofile, None).result()
            release_session(shared)  # the broker still uses it: never the last user here
