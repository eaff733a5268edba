"""The user's verbs against a cluster: the same apply, get and rollout verbs as
the local backend, on TieredModel resources through the Kubernetes API.

`apply` pins each artifact as the local verb does (a local file's sha256 is
filled in; its path must also be reachable from the agents' pods); the
rollout verbs write the status subresource at the resourceVersion they read,
retrying when the controller wrote in between.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tiered import names
from tiered.controller import desired
from tiered.controller.crd import PLURAL
from tiered.controller.kube.render import status_body
from tiered.controller.reconciler import decode_status
from tiered.controller.verbs import (
    CONFLICT_RETRIES,
    checked,
    manual_decision,
    read_documents,
    row_of,
    undo_of,
    with_artifact,
    with_decision,
)
from tiered.errors import ConfigError, Conflict, NotFound
from tiered.rollout import engine
from tiered.rollout.spec import load_tiered_model
from tiered.rollout.wire import API_GROUP, API_VERSION, to_plain


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


class ClusterVerbs:
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

    def apply_file(self, path: Path) -> list[tuple[str, str]]:
        """Create or update every TieredModel in `path`; all are checked first."""
        documents, spec_of = [], {}
        for index, document in enumerate(read_documents(path)):
            where = f"{path}[{index}]" if index else str(path)
            spec, body = checked(document, Path(path).parent, where)
            documents.append((spec.name, body))
            spec_of[spec.name] = spec
        results = []
        for name, body in documents:
            try:
                existing = self._call("get", name)
            except NotFound:
                self._call("create", body)
                results.append((name, "created"))
                continue
            # Compared as parsed specs: the API server fills in schema defaults.
            if to_plain(load_tiered_model(existing, name)) == to_plain(spec_of[name]):
                results.append((name, "unchanged"))
                continue
            existing["spec"] = body["spec"]
            self._call("replace", name, existing)
            results.append((name, "configured"))
        return results

    def rows(self, name: str | None = None) -> list[dict[str, str]]:
        items = ([self._call("get", name)] if name else self._call("list")["items"])
        rows = []
        for item in items:
            status = decode_status(item["metadata"]["name"], item.get("status"))
            spec = load_tiered_model(item, item["metadata"]["name"])
            rows.append(row_of(spec.name, spec, status))
        return rows

    def get(self, name: str) -> dict[str, Any]:
        return self._call("get", name)

    def rollout_verb(self, name: str, verb: str, *, full: bool = False,
                     now: Callable[[], float] = time.time) -> engine.Decision:
        for _ in range(CONFLICT_RETRIES):
            obj = self._call("get", name)
            status = decode_status(name, obj.get("status"))
            spec, when = load_tiered_model(obj, name), now()
            decision = manual_decision(name, spec, status, verb, full=full, now=when)
            if decision.action == names.Action.HOLD:  # already in effect: nothing to write
                return decision
            try:
                self._call("replace_status", name,
                           status_body(obj, with_decision(status, decision, spec, when)))
            except Conflict:
                continue
            return decision
        raise Conflict(f"{name}: the controller kept writing; try again")

    def rollout_undo(self, name: str, to_version: int | None = None) -> desired.Undo:
        """Point the TieredModel's spec at an earlier version's artifact."""
        for _ in range(CONFLICT_RETRIES):
            obj = self._call("get", name)
            found = undo_of(name, load_tiered_model(obj, name),
                            decode_status(name, obj.get("status")), to_version)
            if found.unchanged:
                return found
            try:
                self._call("replace", name, with_artifact(obj, found.artifact))
            except Conflict:
                continue
            return found
        raise Conflict(f"{name}: the controller kept writing; try again")
