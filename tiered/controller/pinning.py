"""A TieredModel document as applied: read from YAML, checked against the
schema and pinned.

Pinning makes a relative artifact path absolute (relative to the applied
file) and fills in a missing sha256 from the file, or from a checkpoint
directory's files (`tiered.files.sha256_tree`, as the build checks it), so
the stored spec names exactly the bytes that will be built. A given sha256
that does not match is refused at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from tiered.errors import ConfigError
from tiered.files import sha256_file, sha256_tree
from tiered.rollout.spec import TieredModel, as_resource, load_tiered_model
from tiered.rollout.status import ArtifactVersion
from tiered.rollout.wire import API_GROUP, API_VERSION, wire_key

MAX_PATH = 4096  # longest artifact path accepted


def read_documents(path: Path) -> list[Mapping[str, Any]]:
    """Every YAML document in `path` (`---` separated), each a mapping."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read: {error}") from error
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except (yaml.YAMLError, ValueError, RecursionError) as error:  # bad dates, huge ints too
        raise ConfigError(f"{path}: invalid YAML: {str(error)[:300]}") from error
    for index, document in enumerate(documents):
        if not isinstance(document, Mapping):
            raise ConfigError(f"{path}: document {index + 1}: expected a mapping, got "
                              f"{type(document).__name__}")
    return documents


def checked(document: Mapping[str, Any], base: Path, where: str
            ) -> tuple[TieredModel, dict[str, Any]]:
    """A document's TieredModel and the resource to store: the document with its
    artifact pinned, in the current API version (an older version's document
    and a flat one are converted; see `as_resource`). The schema is
    checked first, so a mistyped field is named as such, not taken for a
    missing digest."""
    load_tiered_model(_with_digest(document, UNPINNED), where)
    pinned = pin_artifact(document, base, where)
    return load_tiered_model(pinned, where), as_resource(pinned)


UNPINNED = "0" * 64  # a digest that stands in while only the schema is checked


def _with_digest(document: Mapping[str, Any], digest: str) -> Mapping[str, Any]:
    """The document with `digest` where its artifact has no sha256 (else as it is)."""
    nested = isinstance(document.get("spec"), Mapping)
    holder = document["spec"] if nested else document
    artifact = holder.get("artifact")
    if not isinstance(artifact, Mapping) or "sha256" in artifact:
        return document
    holder = {**holder, "artifact": {**artifact, "sha256": digest}}
    return {**document, "spec": holder} if nested else holder


def pin_artifact(document: Mapping[str, Any], base: Path, where: str) -> dict[str, Any]:
    """The document with its artifact's local paths made absolute and its digest pinned."""
    document = dict(document)
    if "spec" in document and not isinstance(document["spec"], Mapping):
        return document  # validation names the malformed spec
    holder = dict(document["spec"]) if "spec" in document else document
    where = f"{where}.spec" if "spec" in document else where
    artifact = holder.get("artifact")
    if not isinstance(artifact, Mapping):
        return document  # validation names the missing or malformed field
    artifact = dict(artifact)
    for key in ("uri", "calibration", "eval"):
        value = artifact.get(key)
        if isinstance(value, str) and value and not urlparse(value).scheme:
            if "\0" in value or len(value) > MAX_PATH:
                raise ConfigError(f"{where}.artifact.{key}: not a usable path")
            artifact[key] = str((base / value).resolve())
    # The digests' keys as the document spells its fields.
    camel = "spec" in document and document.get("apiVersion") == f"{API_GROUP}/{API_VERSION}"
    for data in ("calibration", "eval"):
        pin = f"{data}_sha256"
        _pin_data(artifact, data, wire_key(pin) if camel else pin, where)
    uri = artifact.get("uri")
    if isinstance(uri, str) and (Path(uri).is_file() or Path(uri).is_dir()):
        digest = sha256_file(Path(uri)) if Path(uri).is_file() else sha256_tree(Path(uri))
        given = artifact.get("sha256")
        if given is None:
            artifact["sha256"] = digest
        elif given != digest:
            raise ConfigError(f"{where}.artifact.sha256: {uri} has sha256 {digest}, "
                              f"not {given}")
    elif isinstance(uri, str) and artifact.get("sha256") is None:
        if not urlparse(uri).scheme:
            raise ConfigError(f"{where}.artifact.uri: no such file: {uri}")
        raise ConfigError(f"{where}.artifact.uri: {uri} is not on this machine, so its "
                          "sha256 cannot be computed here; give artifact.sha256")
    holder["artifact"] = artifact
    if "spec" in document:
        document["spec"] = holder
    return document


def _pin_data(artifact: dict[str, Any], key: str, pin: str, where: str) -> None:
    """artifact.<pin>, the digest of a local calibration or eval file, pinned
    (or checked, when given); a URI must come with its digest."""
    value = artifact.get(key)
    if not isinstance(value, str) or not value:
        return
    if Path(value).is_file():
        digest = sha256_file(Path(value))
        given = artifact.get(pin)
        if given is None:
            artifact[pin] = digest
        elif given != digest:
            raise ConfigError(f"{where}.artifact.{pin}: {value} has sha256 {digest}, "
                              f"not {given}")
    elif artifact.get(pin) is None:
        if not urlparse(value).scheme:
            raise ConfigError(f"{where}.artifact.{key}: no such file: {value}")
        raise ConfigError(f"{where}.artifact.{key}: {value} is not on this machine, so its "
                          f"sha256 cannot be computed here; give artifact.{pin}")


def with_artifact(document: Mapping[str, Any], artifact: ArtifactVersion) -> dict[str, Any]:
    """The stored document with its artifact's uri and sha256 set to `artifact`'s
    (the rest, calibration and eval data included, as it was)."""
    document = dict(document)
    nested = isinstance(document.get("spec"), Mapping)
    holder = dict(document["spec"]) if nested else document
    holder["artifact"] = {**holder["artifact"], "uri": artifact.uri, "sha256": artifact.sha256}
    if nested:
        document["spec"] = holder
    return document
