"""What every ``broker policy`` command reads: a directory, a kubelet ConfigMap mount, a bundle.

``check``, ``test``, ``fmt``, ``eval``, ``replay`` and ``build`` take the same three inputs:

* a policy directory (Rego modules, tests and ``data.json`` files);
* a Kubernetes ConfigMap or Secret volume holding one (``..data`` resolved once, ``..*`` entries
  skipped: ``bundle.load_policy_dir``, as ``broker serve`` reads it);
* a bundle (``.tar.gz``: ``broker policy build``'s, or OPA's own ``opa build -b`` /
  ``opa sign`` + ``tar``), read once and verified by ``opa_bundle.read_bundle`` (the signature
  with ``--verification-key``/``--scope`` when it is signed).

The input is read once; OPA's tools (``opa check``, ``opa test``, ``opa fmt``, ``opa eval``) run
on a private staged copy of those bytes, and what they print names the user's files
(``user_paths``): ``DIR/broker/release.rego``, or ``BUNDLE:broker/release.rego``.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from broker.policy import opa_bundle
from broker.policy.bundle import KUBELET_DATA, PolicySource, load_policy_dir
from broker.policy.user_paths import naming_user_files, user_text
from broker.policy.wasm import PolicyLoadError

STAGED = "policy"


@dataclass(frozen=True)
class PolicyInput:
    """A policy as read once: the files OPA's tools see (Rego, tests, data), by relative path."""

    path: Path  # as the user named it
    files: Mapping[str, bytes]
    source: PolicySource | None = None  # a directory or ConfigMap mount, as read
    verified: opa_bundle.VerifiedBundle | None = None  # a bundle, as verified

    @property
    def bundle(self) -> bool:
        return self.verified is not None

    @property
    def kind(self) -> str:
        if self.verified is not None:
            return "bundle"
        mounted = (self.path / KUBELET_DATA).is_symlink()
        return "ConfigMap mount" if mounted else "directory"

    @property
    def shown(self) -> str:
        """How messages name a file of it: ``DIR/…`` or ``BUNDLE:…`` (``user_paths``)."""
        return f"{self.path}:" if self.bundle else str(self.path)

    def user_text(self, text: str, staged: Path) -> str:
        """``text`` from a tool run on ``staged``, naming the user's files instead."""
        return user_text(text, staged, self.shown)


def read_policy_input(
    path: Path, *, verification_key: Path | None = None, scope: str = ""
) -> PolicyInput:
    """The directory, ConfigMap mount or bundle at ``path``, read once.

    Raises:
        ConfigError: a directory that does not read (``load_policy_dir``).
        PolicyLoadError: a bundle that does not read or verify.
    """
    if path.is_dir():
        source = load_policy_dir(path)
        return PolicyInput(path=path, files=source.files, source=source)
    verified = read_bundle_file(path, verification_key=verification_key, scope=scope)
    files = {
        name: content
        for name, content in verified.files.items()
        if name.endswith(".rego") or name == opa_bundle.DATA
    }
    return PolicyInput(path=path, files=files, verified=verified)


def read_bundle_file(
    path: Path, *, verification_key: Path | None = None, scope: str = ""
) -> opa_bundle.VerifiedBundle:
    """A bundle file read once and verified (its signature with ``verification_key``).

    Raises:
        PolicyLoadError: unreadable, or refused by ``opa_bundle.read_bundle``.
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(opa_bundle.MAX_BUNDLE_BYTES + 1)
    except OSError as exc:
        raise PolicyLoadError(f"cannot read the bundle {path}") from exc
    verification = opa_bundle.verification_from_file(verification_key, scope)
    return opa_bundle.read_bundle(raw, source=str(path), verification=verification)


@contextlib.contextmanager
def staged(policy: PolicyInput) -> Iterator[Path]:
    """``policy``'s files in a private directory for OPA's tools; a ``PolicyLoadError`` raised
    inside names the user's files.

    Raises:
        PolicyLoadError: from the work done inside, in the user's file names.
    """
    with tempfile.TemporaryDirectory(prefix="broker-policy-") as tmp:
        root = Path(tmp) / STAGED
        root.mkdir()
        for name, content in policy.files.items():
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        with naming_user_files(root, policy.shown):
            yield root
