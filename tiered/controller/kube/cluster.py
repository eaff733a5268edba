"""A cluster's TieredModels as the user's verbs keep them: the `ModelStore`
seam (`controller/store.py`) on TieredModel resources through the Kubernetes
API, and the client and namespace kubectl would use.

A status is written through the status subresource at the resourceVersion
read (a 409 is a Conflict); a rollout's steps are kept in the status itself
(its history), so a step recorded apart is not kept again, and the steps read
back are the status's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiered.controller.crd import PLURAL
from tiered.controller.reconciler import decode_status
from tiered.controller.store import Record
from tiered.errors import ConfigError, Conflict, NotFound
from tiered.rollout.snapshot import from_history, to_record
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.wire import API_GROUP, API_VERSION, KIND, to_plain


def api_client(kubeconfig: Path | None = None, context: str | None = None):
    """A client from the kubeconfig (its current context, or `context`), else in-cluster."""
    from kubernetes import client, config

    try:
        if kubeconfig is not None or context is not None:
            return config.new_client_from_config(
                config_file=str(kubeconfig) if kubeconfig else None, context=context)
        try:
            return config.new_client_from_config()
        except config.ConfigException:
            config.load_incluster_config()
            return client.ApiClient()
    except config.ConfigException as error:
        raise ConfigError(f"kubeconfig: {error}") from error


IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def current_namespace(kubeconfig: Path | None = None, context: str | None = None) -> str:
    """The namespace kubectl would use: the context's, in a pod its own, else default."""
    from kubernetes import config

    try:
        contexts, active = config.list_kube_config_contexts(
            config_file=str(kubeconfig) if kubeconfig else None)
        chosen = next((c for c in contexts if c["name"] == context), None) if context \
            else active
        namespace = ((chosen or {}).get("context") or {}).get("namespace")
        if namespace:
            return namespace
    except (config.ConfigException, OSError):
        if IN_CLUSTER_NAMESPACE.is_file():
            return IN_CLUSTER_NAMESPACE.read_text().strip() or "default"
    return "default"


class ClusterStore:
    """TieredModel resources in one namespace, as a `ModelStore`."""

    def __init__(self, api, namespace: str) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace

    def _call(self, verb: str, *args: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            method = (f"{verb}_namespaced_custom_object" if verb != "replace_status"
                      else "replace_namespaced_custom_object_status")
            return getattr(self.custom, method)(API_GROUP, API_VERSION, self.namespace,
                                                PLURAL, *args)
        except ApiException as error:
            if error.status == 404:
                raise NotFound(f"{PLURAL}.{API_GROUP} {args[0] if args else ''} not found in "
                               f"namespace {self.namespace}") from None
            if error.status == 409:
                raise Conflict(f"changed by someone else: {error.reason}") from None
            if error.status == 422:
                raise ConfigError(f"the API server refused it: {error.body}") from None
            raise

    def get(self, name: str) -> Record:
        return _record(self._call("get", name))

    def list(self) -> list[Record]:
        return sorted((_record(item) for item in self._call("list")["items"]),
                      key=lambda r: r.name)

    def apply(self, name: str, spec: Mapping[str, Any]) -> Record:
        """Create the resource, or give it `spec`'s spec; compared as parsed
        specs, since the API server fills in the schema's defaults."""
        try:
            existing = self._call("get", name)
        except NotFound:
            return _record(self._call("create", dict(spec)))
        if to_plain(load_tiered_model(existing, name)) == to_plain(load_tiered_model(spec, name)):
            return _record(existing)
        return _record(self._call("replace", name, {**existing, "spec": spec["spec"]}))

    def write_status(self, name: str, revision: Any, *, status: Mapping[str, Any] | None
                     ) -> Record:
        return _record(self._call("replace_status", name, {
            "apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": self.namespace,
                         "resourceVersion": revision},
            "status": status}))

    def record(self, name: str, snapshot: Mapping[str, Any], t: float | None = None) -> None:
        """Nothing to keep: the step is in the status's history already."""

    def history(self, name: str | None = None, after_id: Any = 0
                ) -> list[tuple[Any, float, dict[str, Any]]]:
        """The status's steps after time `after_id`, each its own id."""
        found = []
        for record in [self.get(name)] if name is not None else self.list():
            spec = load_tiered_model(record.spec, record.name)
            found += [(t, t, to_record(snap)) for t, snap in
                      from_history(spec, decode_status(record.name, record.status))
                      if t > after_id]
        return sorted(found, key=lambda step: step[0])


def _record(obj: Mapping[str, Any]) -> Record:
    """The resource as the verbs read a model: its whole object is the spec
    document (load_tiered_model reads it), its resourceVersion the revision."""
    metadata = obj["metadata"]
    return Record(metadata["name"], obj, metadata.get("generation", 0), obj.get("status"),
                  metadata["resourceVersion"], 0.0)
