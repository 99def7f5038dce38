"""The image's SBOM: SPDX 2.3 JSON, made from the build's own inputs.

Everything listed is something the build put in, checked by hash: the Debian packages (the
``.deb`` files' SHA-256 from ``debian.lock``), the Python distributions (the wheels' SHA-256
from ``python.lock``, and the broker's own wheel), and OPA (the binary's SHA-256, its Go
toolchain and every Go module it was built from, as ``go version -m`` reports them). The
document is deterministic: its time is the source date and its namespace names the image digest.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from deploy.image.oci import rfc3339

_SPDX_ID = re.compile(r"[^A-Za-z0-9.-]")


@dataclass(frozen=True)
class Component:
    """One thing in the image: ``kind`` is "deb", "pypi" or "golang" (its purl type)."""

    kind: str
    name: str
    version: str
    sha256: str = ""  # of the file it came as (.deb, .whl, the OPA binary)
    comment: str = ""
    arch: str = ""
    contained_in: str = ""  # the name of the component that carries this one (OPA's modules)

    @property
    def spdx_id(self) -> str:
        return _SPDX_ID.sub("-", f"SPDXRef-{self.kind}-{self.name}-{self.version}")

    def purl(self) -> str:
        version = quote(self.version, safe="")
        if self.kind == "deb":
            return f"pkg:deb/debian/{self.name}@{version}?arch={self.arch}&distro=debian-12"
        if self.kind == "pypi":
            return f"pkg:pypi/{self.name.lower().replace('_', '-')}@{version}"
        return f"pkg:golang/{self.name}@{version}"


def document(
    *, image_name: str, manifest_digest: str, epoch: int, components: Sequence[Component]
) -> dict[str, Any]:
    """The SPDX 2.3 document: the image CONTAINS each component (OPA CONTAINS its modules)."""
    hex_digest = manifest_digest.removeprefix("sha256:")
    image_id = "SPDXRef-image"
    packages: list[dict[str, Any]] = [
        {
            "SPDXID": image_id,
            "name": image_name,
            "versionInfo": manifest_digest,
            "primaryPackagePurpose": "CONTAINER",
            "downloadLocation": "NOASSERTION",
            "filesAnalyzed": False,
            "checksums": [{"algorithm": "SHA256", "checksumValue": hex_digest}],
            "externalRefs": [_purl(f"pkg:oci/{image_name}@sha256%3A{hex_digest}?arch=amd64")],
        }
    ]
    relationships = [
        {
            "spdxElementId": "SPDXRef-DOCUMENT",
            "relationshipType": "DESCRIBES",
            "relatedSpdxElement": image_id,
        }
    ]
    by_name = {component.name: component for component in components}
    for component in components:
        packages.append(_package(component))
        parent = by_name[component.contained_in].spdx_id if component.contained_in else image_id
        relationships.append(
            {
                "spdxElementId": parent,
                "relationshipType": "CONTAINS",
                "relatedSpdxElement": component.spdx_id,
            }
        )
    return {
        "spdxVersion": "SPDX-2.3",
        "dataLicense": "CC0-1.0",
        "SPDXID": "SPDXRef-DOCUMENT",
        "name": f"{image_name}@{manifest_digest}",
        "documentNamespace": f"https://spdx.org/spdxdocs/{image_name}-{hex_digest}",
        "creationInfo": {"created": rfc3339(epoch), "creators": ["Tool: deploy-image"]},
        "documentDescribes": [image_id],
        "packages": packages,
        "relationships": relationships,
    }


def _package(component: Component) -> dict[str, Any]:
    package: dict[str, Any] = {
        "SPDXID": component.spdx_id,
        "name": component.name,
        "versionInfo": component.version,
        "downloadLocation": "NOASSERTION",
        "filesAnalyzed": False,
        "licenseConcluded": "NOASSERTION",
        "licenseDeclared": "NOASSERTION",
        "copyrightText": "NOASSERTION",
        "externalRefs": [_purl(component.purl())],
    }
    if component.kind == "deb":
        package["supplier"] = "Organization: Debian"
    if component.sha256:
        package["checksums"] = [{"algorithm": "SHA256", "checksumValue": component.sha256}]
    if component.comment:
        package["comment"] = component.comment
    return package


def _purl(locator: str) -> dict[str, str]:
    return {
        "referenceCategory": "PACKAGE-MANAGER",
        "referenceType": "purl",
        "referenceLocator": locator,
    }


def go_modules(version_m: str, carrier: str) -> list[Component]:
    """The Go toolchain and modules in ``go version -m`` output, as components of ``carrier``."""
    components = []
    for line in version_m.splitlines():
        fields = line.split()
        if not line.startswith("\t") and fields and fields[-1].startswith("go1"):
            components.append(Component("golang", "stdlib", fields[-1], contained_in=carrier))
        elif len(fields) >= 3 and fields[0] in {"dep", "=>"}:
            if fields[0] == "=>":  # the module above is replaced by this one
                components.pop()
            checksum = f"go.sum {fields[3]}" if len(fields) > 3 else ""
            components.append(
                Component("golang", fields[1], fields[2], comment=checksum, contained_in=carrier)
            )
    return components
