"""Builds ``tests/kbs_conformance`` (the stock guest's reading of KBS answers, on kbs-types 0.18
and RustCrypto) into ``build/kbs-conformance/``, once per machine and then incrementally, in the
two ways guests are built: serde_json's sorted maps, and its ``preserve_order`` (guests whose
attesters pull azure-guest-attestation-sdk). ``make test`` runs this before pytest (crates come
from crates.io, pinned by Cargo.lock); the tests' fixture runs it again, a no-op when built.

    python -m tests.support.kbs_harness     # prints the two binaries and the build time
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CRATE = REPO / "tests" / "kbs_conformance"
TARGET = REPO / "build" / "kbs-conformance"
# regime -> the cargo features that make it
REGIMES = {"sorted": (), "preserve-order": ("--features", "preserve-order")}
BUILD_TIMEOUT_S = 1200  # a cold build took ~40 s on 2 cores; leave room for a busy machine


def build() -> dict[str, Path]:
    """The harness binary of each regime, built if needed.

    Raises:
        RuntimeError: no cargo on PATH, or a build that failed (its output in the message).
    """
    cargo = shutil.which("cargo")
    if cargo is None:
        raise RuntimeError("cargo is needed for the KBS conformance harness (rustup, or the image)")
    TARGET.mkdir(parents=True, exist_ok=True)
    binaries: dict[str, Path] = {}
    # pytest-xdist workers share the target directory: one builds and copies at a time, so
    # that each copy is the regime it is named after.
    with (TARGET / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for regime, features in REGIMES.items():
            command = [cargo, "build", "--locked", "--quiet", "--manifest-path"]
            command += [str(CRATE / "Cargo.toml"), "--target-dir", str(TARGET), *features]
            built = subprocess.run(
                command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False
            )
            if built.returncode != 0:
                raise RuntimeError(f"cargo build ({regime}) failed:\n{built.stderr}")
            binaries[regime] = TARGET / f"kbs-conformance-{regime}"
            shutil.copy2(TARGET / "debug" / "kbs-conformance", binaries[regime])
    return binaries


def main() -> None:
    started = time.monotonic()
    for regime, binary in build().items():
        sys.stdout.write(f"{regime}: {binary}\n")
    sys.stdout.write(f"built in {time.monotonic() - started:.1f} s\n")


if __name__ == "__main__":
    main()
