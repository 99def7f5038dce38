"""``broker weights encrypt … gs://bucket/path``: encrypted files go to Cloud Storage.

The files are encrypted locally first (ciphertext only on local disk, in a private temporary
directory), then uploaded with CRC32C checks: one object for a file, or one object per file
under the prefix for a directory (``manifest.json`` last, so a reader that finds the manifest
finds every file it names). ``STORAGE_EMULATOR_HOST`` points the client at an emulator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.core.errors import ConfigError, InputError

GCS_EXTRA = "pip install 'sealed-runner-broker[gcs]'"


def split_gs_uri(uri: str) -> tuple[str, str]:
    """``(bucket, object or prefix)`` of ``gs://bucket/name``.

    Raises:
        ConfigError: not ``gs://BUCKET/NAME`` (a usage error: exit 2).
    """
    bucket, _, name = uri.removeprefix("gs://").partition("/")
    if not uri.startswith("gs://") or not bucket or not name.strip("/"):
        raise ConfigError("OUT", f"{uri}: expected gs://BUCKET/OBJECT (or gs://BUCKET/PREFIX/)")
    return bucket, name


def storage_client() -> Any:
    """A google-cloud-storage client (application default credentials, or the emulator).

    Raises:
        ConfigError: google-cloud-storage is not installed (the ``[gcs]`` extra).
    """
    try:
        from google.cloud import storage  # type: ignore[attr-defined,import-untyped,unused-ignore]  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError("OUT", f"gs:// needs google-cloud-storage: {GCS_EXTRA}") from exc
    return storage.Client()


def upload(local: Path, uri: str, *, client: Any) -> list[str]:
    """Upload ``local`` (a file, or every file of a directory) to ``uri``; the URIs written.

    Raises:
        InputError: the upload failed (the object names the URI and the storage error).
    """
    from google.api_core.exceptions import GoogleAPIError  # noqa: PLC0415
    from google.auth.exceptions import GoogleAuthError  # noqa: PLC0415

    bucket_name, name = split_gs_uri(uri)
    bucket = client.bucket(bucket_name)
    if local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name == "manifest.json")  # the manifest last
        prefix = name.rstrip("/") + "/"
        plan = [(p, prefix + p.relative_to(local).as_posix()) for p in files]
    else:
        plan = [(local, name)]
    written = []
    for path, object_name in plan:
        target = f"gs://{bucket_name}/{object_name}"
        try:
            bucket.blob(object_name).upload_from_filename(str(path), checksum="crc32c")
        except (GoogleAPIError, GoogleAuthError, OSError) as exc:
            raise InputError(f"{target}: upload failed: {type(exc).__name__}: {exc}") from exc
        written.append(target)
    return written
