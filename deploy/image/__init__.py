"""Build tooling for the broker's OCI image (``make image``); not part of the broker package.

``build`` assembles the root filesystem from pinned Debian packages, the locked Python wheels,
the broker's own wheel and a reproducible OPA, then ``oci`` writes the layers and the OCI image
layout with every varying field normalised, so the same commit gives the same manifest digest.
"""
