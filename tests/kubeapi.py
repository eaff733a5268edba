"""An in-memory Kubernetes API server double for tests (DESIGN.md rule 7).

`FakeKubeAPI` speaks the Kubernetes REST and watch protocol over real HTTP/1.1
on 127.0.0.1, so the controller is exercised through the official `kubernetes`
client, and the real `kubectl` (apply, get, describe, wait, api-resources,
explain) runs against it, exactly as against a cluster::

    with FakeKubeAPI() as api:
        config.load_kube_config(config_file=str(api.kubeconfig(tmp_path / "kc")))
        ...

Implemented, following the real API server:
- Kinds (all namespaced): every served version of the CRD in `crd` (by default
  helm/tiered/crds/tieredmodels.tiered.dev.yaml; group, versions, names, status
  subresource and printer columns read from it), apps/v1 deployments and
  daemonsets, v1 services, pods, configmaps and events, coordination.k8s.io/v1
  leases, discovery.k8s.io/v1 endpointslices. Paths
  /api/v1/namespaces/{ns}/{plural}[/{name}[/status]],
  /apis/{group}/{version}/namespaces/{ns}/..., the all-namespaces collections
  /api/v1/{plural} and /apis/{g}/{v}/{plural}, and /version.
- Discovery: /api, /apis, /api/v1, /apis/{g}, /apis/{g}/{v} (APIVersions,
  APIGroupList, APIGroup, APIResourceList with singularName, shortNames,
  categories, verbs, namespaced, kind, and the status subresources), and the
  aggregated form (APIGroupDiscoveryList, apidiscovery.k8s.io v2 or v2beta1)
  when the Accept header asks for it first, as kubectl 1.33 does. Versions are
  ordered by Kubernetes' version priority (v1 > v1beta1 > v1alpha2 > v1alpha1).
- OpenAPI v3 for the custom resource: /openapi/v3 lists one document per
  served version; each has the paths with their operations (PATCH taking
  json-patch, merge-patch and apply-patch, no strategic merge), query
  parameters (fieldValidation, fieldManager, dryRun), x-kubernetes-group-
  version-kind, and the version's schema. That is what kubectl apply checks
  before sending fieldValidation=Strict instead of validating client-side.
- Custom resource versions (conversion strategy None): all versions share one
  store; a write is validated, pruned and defaulted by its request version's
  schema, then stored at the storage version (only apiVersion changes) and
  pruned by that version's schema; a read, list or watch event is converted
  to the request version and pruned and defaulted by its schema. A request at
  a deprecated version gets its deprecationWarning as a `Warning: 299` header.
- Server-side field validation (fieldValidation=Strict|Warn|Ignore, Warn when
  absent) for custom resources: unknown fields are a 400 "strict decoding
  error: unknown field ..." under Strict and a Warning header each under Warn.
  A request body's integral numbers (2.0) are stored as integers, as Go's
  decoding into unstructured does.
- Tables: a GET, list or watch of custom resources whose Accept header asks
  first for `application/json;as=Table;v=v1;g=meta.k8s.io` (or v1beta1) gets a
  meta.k8s.io Table: Name, then the version's additionalPrinterColumns (Age
  only when it declares none) with cells typed as the CRD table convertor types
  them (JSONPath subset: fields, ['key'], [n], [*], filters [?(@.f == "x")];
  dates as ages like "5m"); rows carry PartialObjectMetadata, the object or
  nothing per includeObject=Metadata|Object|None; a watch sends each event's
  object as a one-row Table.
- Server-set metadata: uid, creationTimestamp, namespace, resourceVersion (one
  global counter, bumped on every write, deletions included), generation (kinds
  with a spec generation: tieredmodels, deployments, daemonsets; 1 at create,
  +1 when anything outside metadata/status changes, +1 when deletionTimestamp is
  set). A no-op update writes nothing and keeps the resourceVersion.
- get, list (labelSelector: =, ==, !=, in, notin, exists, !exists; fieldSelector
  with =, ==, != and \\, \\= escapes on metadata.name / metadata.namespace, and
  for events also involvedObject.{kind,namespace,name,uid,apiVersion,
  resourceVersion,fieldPath}, reason, reportingComponent, type and source (its
  component, else reportingComponent), as kubectl describe lists them), create
  (generateName, 409 AlreadyExists, 422 on a missing/invalid name), replace (409 Conflict on a stale
  resourceVersion; custom resources require one, 422 otherwise), patch
  (merge-patch; json-patch add/remove/replace/move/copy/test; strategic merge
  for built-in kinds with list merge keys for containers, env, volumes,
  volumeMounts, ports, ownerReferences, conditions, union for finalizers and
  $patch/$deleteFromPrimitiveList directives; 415 for strategic merge on custom
  resources as the real server), delete and deletecollection.
- Status subresource (the CRD's, deployments, daemonsets, services, pods):
  writes to the main resource keep the stored status; writes to /status change
  only status. Status is dropped on create.
- Finalizers: delete sets deletionTimestamp and deletionGracePeriodSeconds=0
  (MODIFIED); the update that empties finalizers removes the object (DELETED,
  whose object is the last stored state). New finalizers on a deleting object
  are refused (422). Preconditions (uid, resourceVersion) in DeleteOptions.
- Garbage collection, synchronous: removing an object deletes (through the same
  delete path, so finalizers apply) the dependents in its namespace whose
  ownerReferences all name removed objects; propagationPolicy=Orphan strips the
  ownerReferences instead. Foreground is treated as Background.
- Watch (?watch=true): chunked newline-delimited JSON events; resourceVersion
  absent or "0" starts with synthetic ADDED events; a later version replays the
  retained history after it; one older than the history window (`history`
  events, or everything before `compact()`) gets a single ERROR event with a
  410 Expired Status, then the stream ends. Label/field selectors apply, with
  ADDED/DELETED when an object enters/leaves the selection. timeoutSeconds ends
  the stream; allowWatchBookmarks sends BOOKMARK events every
  `bookmark_interval` seconds. `drop_watches()` and `stop()` end every stream.
- Custom resources are pruned, defaulted and validated against their version's
  openAPIV3Schema in the CRD: type, nullable, required, enum, minimum/maximum
  (+exclusive), minLength/maxLength, pattern, minItems/maxItems,
  additionalProperties, preserve-unknown-fields. An update is ratcheted (as
  since Kubernetes 1.30): an error where the update changes nothing (the
  value, or for a missing field the object holding it, equal to the old
  object's at the request version) is let through.
  Not validated: formats, x-kubernetes-validations (CEL), int-or-string,
  list-type/map-type, embedded resources.
- Built-in kinds get the server defaults a spec comparison would trip over
  (Deployment/DaemonSet strategy, revisionHistoryLimit, pod restartPolicy,
  dnsPolicy, container imagePullPolicy, terminationMessage*, port protocol;
  Service type, clusterIP(s), targetPort) and Go zero-valued status
  (DaemonSetStatus counters, which the client's models require).
- Errors are v1 Status objects with the real reasons, messages and details.

Left out: authentication/authorization (any token works), namespaces as
objects (no existence check), server-side apply (415), managedFields, dryRun,
list paging (limit is ignored, which the API allows), resourceVersionMatch,
"too large resource version" waits, the deprecated /watch/ paths,
sendInitialEvents, admission, validation of built-in kinds and their full
defaulting, field selectors of other kinds (e.g. pods' spec.nodeName) and the
CRD's selectableFields, conversion webhooks, cluster-scoped custom resources,
graceful pod-style deletion, the "orphan"/"foregroundDeletion" finalizers,
asynchronous GC timing (here dependents go in the same request), protobuf and
CBOR, PartialObjectMetadata answers (`as=PartialObjectMetadata`), Tables for
built-in kinds (they answer plain JSON, which kubectl prints as NAME and AGE),
/openapi/v2 (404) and OpenAPI for built-in kinds (so `kubectl apply` of a
built-in kind needs --validate=false), and field validation of built-in kinds
and of duplicate fields.

Test hooks: `objects(plural)` (snapshot, custom resources at the version each
is stored at), `set_storage_version(v)` (a CRD update moving storage), `events` (Write(verb, path,
resource_version) per write; GC writes have verb "gc"; a no-op update is logged
with the unchanged version), `requests` (method, path, query, content_type),
`fail_next(method, path_regex, code)`, `compact()`, `drop_watches()`,
`watching` and `wait_for_watches(n)` (open watch streams).
"""

from __future__ import annotations

import copy
import datetime
import decimal
import functools
import hashlib
import json
import random
import re
import select
import socket
import threading
import time
import uuid
import zlib
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar, NamedTuple, Self
from urllib.parse import parse_qs, urlsplit

import yaml

CRD_PATH = Path(__file__).resolve().parents[1] / "helm/tiered/crds/tieredmodels.tiered.dev.yaml"
TOKEN = "fake-kube-token"


class Column(NamedTuple):
    """An additionalPrinterColumn of a custom resource version."""
    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0
    format: str = ""


AGE = Column("Age", "date", ".metadata.creationTimestamp")  # what a CRD without columns gets


@dataclass(frozen=True)
class Kind:
    group: str
    version: str
    plural: str
    kind: str
    status: bool = False  # has a status subresource
    generation: bool = False  # metadata.generation tracks spec
    custom: bool = False
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()  # custom resources: the version's printer columns
    deprecation: str | None = None  # the Warning every request at this version gets

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> str:  # as in error messages: "deployments.apps"
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind


BUILTIN_KINDS = (
    Kind("apps", "v1", "deployments", "Deployment", True, True, singular="deployment",
         short_names=("deploy",), categories=("all",)),
    Kind("apps", "v1", "daemonsets", "DaemonSet", True, True, singular="daemonset",
         short_names=("ds",), categories=("all",)),
    Kind("", "v1", "services", "Service", True, singular="service", short_names=("svc",),
         categories=("all",)),
    Kind("", "v1", "pods", "Pod", True, singular="pod", short_names=("po",),
         categories=("all",)),  # written by tests as a kubelet would report them
    Kind("", "v1", "configmaps", "ConfigMap", singular="configmap", short_names=("cm",)),
    Kind("", "v1", "events", "Event", singular="event", short_names=("ev",)),
    Kind("coordination.k8s.io", "v1", "leases", "Lease", singular="lease"),
    Kind("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler",
         singular="horizontalpodautoscaler", short_names=("hpa",), categories=("all",)),
    Kind("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice",
         singular="endpointslice"),  # written by tests
)


def crd_kinds(crd: dict) -> tuple[list[Kind], dict[str, dict | None], str]:
    """A CustomResourceDefinition's served versions as Kinds, each version's
    openAPIV3Schema, and the storage version."""
    spec, names = crd["spec"], crd["spec"]["names"]
    if spec.get("scope", "Namespaced") != "Namespaced":
        raise ValueError("the double serves namespaced custom resources only")
    kinds, schemas = [], {}
    for v in spec["versions"]:
        if not v.get("served"):
            continue
        columns = tuple(Column(c["name"], c["type"], c["jsonPath"], c.get("description", ""),
                               c.get("priority", 0), c.get("format", ""))
                        for c in v.get("additionalPrinterColumns") or ()) or (AGE,)
        warning = v.get("deprecationWarning") or (
            f"{spec['group']}/{v['name']} {names['kind']} is deprecated"
            if v.get("deprecated") else None)
        kinds.append(Kind(spec["group"], v["name"], names["plural"], names["kind"],
                          "status" in (v.get("subresources") or {}), True, True,
                          names.get("singular") or names["kind"].lower(),
                          tuple(names.get("shortNames") or ()),
                          tuple(names.get("categories") or ()), columns, warning))
        schemas[v["name"]] = (v.get("schema") or {}).get("openAPIV3Schema")
    storage = next(v["name"] for v in spec["versions"] if v.get("storage"))
    return kinds, schemas, storage


def version_priority(version: str) -> tuple:
    """Kubernetes' ordering of versions (v2 > v1 > v1beta2 > v1beta1 > v1alpha1 >
    anything else), as a sort key: the highest sorts first."""
    m = re.fullmatch(r"v(\d+)(?:(alpha|beta)(\d+))?", version)
    if not m:
        return (1, 0, 0, 0, version)
    stage = {"alpha": 1, "beta": 2, None: 3}[m[2]]
    return (0, -stage, -int(m[1]), -int(m[3] or 0), version)


class Write(NamedTuple):
    verb: str
    path: str
    resource_version: str


class Request(NamedTuple):
    method: str
    path: str
    query: dict
    content_type: str


class ApiError(Exception):
    REASONS: ClassVar[dict[int, str]] = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
               409: "Conflict", 410: "Gone", 415: "UnsupportedMediaType", 422: "Invalid",
               429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}

    def __init__(self, code: int, message: str, reason: str | None = None,
                 details: dict | None = None):
        super().__init__(message)
        self.code, self.message, self.details = code, message, details
        self.reason = reason or self.REASONS.get(code, "Unknown")

    def status(self) -> dict:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}
        if self.details is not None:
            body["details"] = self.details
        return body


def _not_found(kind: Kind, name: str) -> ApiError:
    return ApiError(404, f'{kind.resource} "{name}" not found', "NotFound",
                    {"name": name, "group": kind.group, "kind": kind.plural})


def _conflict(kind: Kind, name: str, why: str) -> ApiError:
    return ApiError(409, f'Operation cannot be fulfilled on {kind.resource} "{name}": {why}',
                    "Conflict", {"name": name, "group": kind.group, "kind": kind.plural})


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def _invalid(kind: Kind, name: str, errs: list[tuple[str, str, str]]) -> ApiError:
    texts = [f"{field}: {msg}" for field, _, msg in errs]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    causes = [{"reason": r, "message": m, "field": f} for f, r, m in errs]
    return ApiError(422, f'{kind.qualified_kind} "{name}" is invalid: {joined}', "Invalid",
                    {"name": name, "group": kind.group, "kind": kind.kind, "causes": causes})


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- patches

def merge_patch(target, patch):
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


_MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
               "env": "name", "volumes": "name", "volumeMounts": "mountPath",
               "imagePullSecrets": "name", "ownerReferences": "uid", "conditions": "type",
               "ports": "containerPort|port"}


def strategic_merge_patch(target, patch):
    """Strategic merge patch for the list fields controllers touch (see _MERGE_KEYS)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.split("/", 1)[1]
            out[field] = [x for x in out.get(field) or [] if x not in value]
        elif key.startswith("$"):
            continue  # $setElementOrder, $retainKeys: order and retention not modelled
        elif value is None or isinstance(value, dict) and value.get("$patch") == "delete":
            out.pop(key, None)
        elif isinstance(value, list) and key == "finalizers":
            old = list(out.get(key) or [])
            out[key] = old + [x for x in value if x not in old]
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, _MERGE_KEYS[key])
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


def _merge_list(old: list, patch: list, keys: str) -> list:
    out = copy.deepcopy(old)
    for item in patch:
        key = next((k for k in keys.split("|") if isinstance(item, dict) and k in item), None)
        if key is None:
            out.append(copy.deepcopy(item))
            continue
        at = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(key) == item[key]),
                  None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is not None:
            out[at] = strategic_merge_patch(out[at], item)
        else:
            out.append(strategic_merge_patch({}, item))
    return out


def json_patch(doc, ops):
    """RFC 6902 JSON patch; raises ValueError on a failed op."""
    if not isinstance(ops, list):
        raise TypeError("json patch must be a list of operations")
    doc = copy.deepcopy(doc)

    def walk(path):
        if path == "":
            return None, None
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in path.split("/")[1:]]
        node = doc
        for t in tokens[:-1]:
            node = node[int(t)] if isinstance(node, list) else node[t]
        return node, tokens[-1]

    def get(path):
        parent, last = walk(path)
        if parent is None:
            return doc
        return parent[int(last)] if isinstance(parent, list) else parent[last]

    def remove(path):
        parent, last = walk(path)
        return parent.pop(int(last)) if isinstance(parent, list) else parent.pop(last)

    def add(path, value):
        nonlocal doc
        parent, last = walk(path)
        if parent is None:
            doc = value
        elif isinstance(parent, list):
            parent.insert(len(parent) if last == "-" else int(last), value)
        else:
            parent[last] = value

    for op in ops:
        kind, path = op.get("op"), op.get("path", "")
        try:
            if kind == "add":
                add(path, copy.deepcopy(op["value"]))
            elif kind == "remove":
                remove(path)
            elif kind == "replace":
                get(path)  # must exist
                if path:
                    remove(path)
                add(path, copy.deepcopy(op["value"]))
            elif kind == "move":
                add(path, remove(op["from"]))
            elif kind == "copy":
                add(path, copy.deepcopy(get(op["from"])))
            elif kind == "test":
                if get(path) != op.get("value"):
                    raise ValueError(f"testing value {path} failed")
            else:
                raise ValueError(f"Unexpected kind: {kind}")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise ValueError(f"{kind} operation does not apply: doc is missing path: "
                             f"\"{path}\": missing value ({e!r})") from e
    return doc


# ---------------------------------------------------------------- selectors

def parse_label_selector(text: str):
    """Returns a predicate over a labels dict; raises ValueError on bad syntax."""
    reqs = []
    for part in re.findall(r"(?:[^,(]|\([^)]*\))+", text or ""):
        part = part.strip()
        if m := re.fullmatch(r"([^\s!=]+)\s*(==|=|!=)\s*([^\s,]*)", part):
            k, op, v = m.groups()
            reqs.append((lambda lb, k=k, v=v: lb.get(k) == v) if op != "!=" else
                        (lambda lb, k=k, v=v: lb.get(k) != v))
        elif m := re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", part):
            k, op, vals = m.group(1), m.group(2), {x.strip() for x in m.group(3).split(",")}
            reqs.append((lambda lb, k=k, s=vals: k in lb and lb[k] in s) if op == "in" else
                        (lambda lb, k=k, s=vals: lb.get(k) not in s))
        elif m := re.fullmatch(r"!\s*([^\s!=]+)", part):
            missing = m.group(1)
            reqs.append(lambda lb, k=missing: k not in lb)
        elif re.fullmatch(r"[^\s!=(),]+", part):
            reqs.append(lambda lb, k=part: k in lb)
        elif part:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return lambda labels: all(r(labels or {}) for r in reqs)


# Every kind selects on metadata.name and metadata.namespace; events also on
# these (the real registry's event field set; a missing value reads as "").
EVENT_FIELDS = ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                "involvedObject.uid", "involvedObject.apiVersion",
                "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
                "reportingComponent", "source", "type")


def _field_value(obj: dict, field: str) -> str:
    if field == "source":  # the component, else the reporting controller
        return (obj.get("source") or {}).get("component") or obj.get("reportingComponent") or ""
    node = obj
    for part in field.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return "" if node is None else str(node)


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, current, i = [], "", 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            current, i = current + text[i:i + 2], i + 2
            continue
        if text[i] == sep:
            parts.append(current)
            current = ""
        else:
            current += text[i]
        i += 1
    return [*parts, current]


def _unescape_field_value(value: str) -> str:
    out, i = "", 0
    while i < len(value):
        if value[i] == "\\":
            if i + 1 >= len(value) or value[i + 1] not in "\\,=":
                raise ValueError(f"invalid field selector value: {value!r}")
            out, i = out + value[i + 1], i + 2
        else:
            out, i = out + value[i], i + 1
    return out


def parse_field_selector(text: str, plural: str = ""):
    """A predicate over whole objects of `plural`; raises ValueError on a field
    the kind does not select on. Terms are comma-separated `f=v`, `f==v`, `f!=v`;
    `\\,`, `\\=` and `\\\\` escape inside values."""
    allowed = {"metadata.name", "metadata.namespace"}
    if plural == "events":
        allowed |= set(EVENT_FIELDS)
    reqs = []
    for part in filter(None, (p.strip() for p in _split_unescaped(text or "", ","))):
        m = re.fullmatch(r"([^!=]+)(==|=|!=)(.*)", part)
        if not m or m.group(1) not in allowed:
            raise ValueError(f'field label not supported: {m.group(1) if m else part}')
        field, op, value = m.groups()
        reqs.append((field, op == "!=", _unescape_field_value(value)))
    return lambda obj: all((_field_value(obj, f) == v) != neg for f, neg, v in reqs)


# ---------------------------------------------------------------- CRD schema

@functools.lru_cache(maxsize=4)
def _read_crd(path: Path, mtime: float) -> dict:
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_crd(path: Path = CRD_PATH) -> dict:
    """The CustomResourceDefinition in `path` (a copy: callers may change it)."""
    return copy.deepcopy(_read_crd(path, path.stat().st_mtime))


def prune_and_default(value, s: dict, unknown: list | None = None, path: str = ""):
    """Structural pruning of unknown fields, dropping of non-nullable nulls, defaulting.
    The paths of pruned fields (`spec.foo`) go into `unknown`."""
    if isinstance(value, dict) and s.get("type") == "object":
        props, extra = s.get("properties"), s.get("additionalProperties")
        keep = s.get("x-kubernetes-preserve-unknown-fields") or extra is True
        out = {}
        for k, v in value.items():
            sub = (props or {}).get(k) or (extra if isinstance(extra, dict) else None)
            where = f"{path}.{k}" if path else k
            if sub is None:
                if keep:
                    out[k] = v
                elif unknown is not None:
                    unknown.append(where)
                continue
            if v is None and not sub.get("nullable"):
                continue
            out[k] = prune_and_default(v, sub, unknown, where)
        for k, sub in (props or {}).items():
            if k not in out and "default" in sub:
                out[k] = prune_and_default(copy.deepcopy(sub["default"]), sub)
        return out
    if isinstance(value, list) and "items" in s:
        return [prune_and_default(x, s["items"], unknown, f"{path}[{i}]")
                for i, x in enumerate(value)]
    return value


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool,
          "integer": int, "number": (int, float)}


def _unchanged(old: dict, new: dict, path: str) -> bool:
    """Whether the value at an error's `path` (or, for a missing field, the
    deepest part of it that is there) is the same in `old` and `new`."""
    steps = [int(t) if t.isdigit() else t for t in re.findall(r"[^.\[\]]+", path)]
    for depth in range(len(steps), -1, -1):
        here, there, found = new, old, True
        for step in steps[:depth]:
            try:
                here, there = here[step], there[step]
            except (KeyError, IndexError, TypeError):
                found = False
                break
        if found:
            return here == there
    return False


def validate(value, s: dict, path: str, errs: list) -> None:
    if value is None:
        if not s.get("nullable"):
            errs.append((path, "FieldValueRequired", "Required value"))
        return
    t = s.get("type")
    if t and (not isinstance(value, _TYPES[t]) or (t != "boolean" and isinstance(value, bool))):
        actual = {dict: "object", list: "array", str: "string", bool: "boolean",
                  int: "integer", float: "number"}.get(type(value), "unknown")
        errs.append((path, "FieldValueTypeInvalid",
                     f'Invalid value: "{actual}": {path} in body must be of type {t}: "{actual}"'))
        return
    show = json.dumps(value)
    if "enum" in s and value not in s["enum"]:
        allowed = ", ".join(json.dumps(x) for x in s["enum"])
        errs.append((path, "FieldValueNotSupported",
                     f"Unsupported value: {show}: supported values: {allowed}"))
    for key, ex, cmp, word in (("minimum", "exclusiveMinimum", lambda a, b: a < b, "greater"),
                               ("maximum", "exclusiveMaximum", lambda a, b: a > b, "less")):
        if key in s and isinstance(value, (int, float)):
            bad = cmp(value, s[key]) or (s.get(ex) and value == s[key])
            if bad:
                rel = f"{word} than" if s.get(ex) else f"{word} than or equal to"
                errs.append((path, "FieldValueInvalid",
                             f"Invalid value: {show}: {path} in body should be {rel} {s[key]}"))
    if isinstance(value, str):
        if len(value) < s.get("minLength", 0):
            errs.append((path, "FieldValueInvalid", (f"Invalid value: {show}: {path} in body "
                         f"should be at least {s['minLength']} chars long")))
        if "maxLength" in s and len(value) > s["maxLength"]:
            errs.append((path, "FieldValueTooLong", (f"Too long: may not be more than "
                         f"{s['maxLength']} bytes")))
        if "pattern" in s and not re.search(s["pattern"], value):
            errs.append((path, "FieldValueInvalid", (f"Invalid value: {show}: {path} in body "
                         f"should match '{s['pattern']}'")))
    if isinstance(value, list):
        if len(value) < s.get("minItems", 0):
            errs.append((path, "FieldValueInvalid", (f"Invalid value: {len(value)}: {path} in "
                         f"body should have at least {s['minItems']} items")))
        if "maxItems" in s and len(value) > s["maxItems"]:
            errs.append((path, "FieldValueTooMany", (f"Too many: {len(value)}: must have at most "
                         f"{s['maxItems']} items")))
        for i, item in enumerate(value):
            if "items" in s:
                validate(item, s["items"], f"{path}[{i}]", errs)
    if isinstance(value, dict):
        for k in s.get("required", []):
            if k not in value:
                errs.append((f"{path}.{k}".lstrip("."), "FieldValueRequired", "Required value"))
        extra = s.get("additionalProperties")
        for k, v in value.items():
            sub = s.get("properties", {}).get(k) or (extra if isinstance(extra, dict) else None)
            if sub is not None and not (path == "" and k == "metadata"):
                validate(v, sub, f"{path}.{k}".lstrip("."), errs)


# ---------------------------------------------------------------- printer columns

_JSONPATH_TOKEN = re.compile(
    r"\.\*|\[\*\]|\.((?:[^.\[\]\\]|\\.)+)|\[(-?\d+)\]|\['([^']*)'\]|\[\"([^\"]*)\"\]"
    r"|\[\?\(@((?:\.[^.\s=!<>()]+)+)\s*(?:(==|!=|<=|>=|<|>)\s*(\"[^\"]*\"|'[^']*'|[^\s)]+))?\s*\)\]")


def jsonpath(obj, path: str) -> list:
    """The values `path` finds in `obj`, in order; missing keys find nothing.
    The subset printer columns use: `.a.b`, `['a']`, `[0]`, `[-1]`, `[*]`, `.*`
    and filters `[?(@.a.b == "x")]` (==, !=, <, <=, >, >=, or bare existence)."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    path = path.removeprefix("$")
    nodes, at = [obj], 0
    while at < len(path):
        m = _JSONPATH_TOKEN.match(path, at)
        if not m:
            raise ValueError(f"unsupported JSONPath {path!r} at {path[at:]!r}")
        at = m.end()
        key = m[1].replace("\\", "") if m[1] else m[3] if m[3] is not None else m[4]
        found = []
        for node in nodes:
            if m[0] in (".*", "[*]"):
                found += list(node.values()) if isinstance(node, dict) else \
                    list(node) if isinstance(node, list) else []
            elif key is not None:
                if isinstance(node, dict) and key in node:
                    found.append(node[key])
            elif m[2] is not None:
                i = int(m[2])
                if isinstance(node, list) and -len(node) <= i < len(node):
                    found.append(node[i])
            elif isinstance(node, list):  # a filter keeps the items that pass it
                found += [x for x in node if _passes(x, m[5], m[6], m[7])]
        nodes = found
    return nodes


def _passes(item, field: str, op: str | None, literal: str | None) -> bool:
    values = jsonpath(item, field)
    if op is None:
        return bool(values)
    if not values:
        return False
    value = values[0]
    if literal[0] in "'\"":
        want = literal[1:-1]
    else:
        want = {"true": True, "false": False}.get(literal)
        if want is None:
            want = float(literal)
    if op in ("==", "!="):
        same = value == want and type(value) is not bool or value is want
        return same if op == "==" else not same
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not isinstance(want, float):
        return False
    return {"<": value < want, "<=": value <= want, ">": value > want, ">=": value >= want}[op]


def _go_float(value: float) -> str:
    """%v of a float64: the shortest digits, in e-notation below 1e-4 and from 1e6."""
    if value == 0 or value != value or value in (float("inf"), float("-inf")):
        return {0: "0"}.get(value, "NaN" if value != value else "+Inf" if value > 0 else "-Inf")
    _, raw, exponent = decimal.Decimal(repr(abs(value))).as_tuple()
    point = len(raw) + exponent  # where the decimal point falls after the digits' start
    digits = "".join(map(str, raw)).rstrip("0")
    sign, exp = "-" if value < 0 else "", point - 1
    if exp < -4 or exp >= 6:
        mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{mantissa}e{exp:+03d}"
    if point <= 0:
        return f"{sign}0.{'0' * -point}{digits}"
    if point >= len(digits):
        return sign + digits + "0" * (point - len(digits))
    return f"{sign}{digits[:point]}.{digits[point:]}"


def go_text(value) -> str:
    """A JSON value as Go's fmt prints the decoded interface{} (as kubectl's
    JSONPath output does): maps as map[k:v], lists as [a b], floats as %v."""
    if value is None:
        return "<nil>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _go_float(value)
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{go_text(v)}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, list):
        return "[" + " ".join(go_text(v) for v in value) + "]"
    return str(value)


def human_duration(seconds: float) -> str:
    """kubectl's short ages: 45s, 5m30s, 12m, 3h20m, 10h, 3d4h, 30d, 2y45d."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    days = hours // 24
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return f"{days // 365}y{days % 365}d" if days % 365 else f"{days // 365}y"
    return f"{days // 365}y"


def printer_cell(column: Column, obj: dict, now: float | None = None):
    """One Table cell as the CRD table convertor makes it: the first value the
    column's JSONPath finds, typed by the column (None when nothing is found)."""
    found = jsonpath(obj, column.json_path)
    value = found[0] if found else None
    if value is None:
        return None
    if column.type == "string":
        return go_text(value)
    if column.type == "integer" and isinstance(value, (int, float)) and \
            not isinstance(value, bool):
        return int(value)
    if column.type == "number" and isinstance(value, (int, float)) and \
            not isinstance(value, bool):
        return float(value)
    if column.type == "boolean" and isinstance(value, bool):
        return value
    if column.type == "date" and isinstance(value, str):
        try:
            stamp = datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(
                tzinfo=datetime.timezone.utc).timestamp()
        except ValueError:
            return "<invalid>"
        return human_duration((time.time() if now is None else now) - stamp)
    return None


NAME_COLUMN = {"name": "Name", "type": "string", "format": "name", "priority": 0,
               "description": "Name must be unique within a namespace."}


def table(kind: Kind, objects: list[dict], resource_version: str, version: str = "v1",
          include: str = "Metadata") -> dict:
    """A meta.k8s.io Table of custom resources: Name, then the version's printer
    columns; each row carries the object as `include` says (None, Metadata, Object)."""
    columns = [NAME_COLUMN] + [
        {"name": c.name, "type": c.type, "format": c.format, "priority": c.priority,
         "description": c.description or
         f"Custom resource definition column (in JSONPath format): {c.json_path}"}
        for c in kind.columns]
    rows = []
    for obj in objects:
        row: dict = {"cells": [obj["metadata"]["name"],
                               *(printer_cell(c, obj) for c in kind.columns)]}
        if include == "Object":
            row["object"] = obj
        elif include != "None":
            row["object"] = {"kind": "PartialObjectMetadata",
                             "apiVersion": f"meta.k8s.io/{version}",
                             "metadata": obj["metadata"]}
        rows.append(row)
    return {"kind": "Table", "apiVersion": f"meta.k8s.io/{version}",
            "metadata": {"resourceVersion": resource_version},
            "columnDefinitions": columns, "rows": rows}


def _media_types(accept: str) -> list[tuple[str, dict]]:
    out = []
    for part in (accept or "").split(","):
        fields = [f.strip() for f in part.split(";")]
        params = dict(f.split("=", 1) for f in fields[1:] if "=" in f)
        out.append((fields[0], params))
    return out


def _negotiate(accept: str, kind: str, group: str, versions: tuple[str, ...]) -> str | None:
    """The version of `kind` (as=) in `group` (g=) the Accept header asks for
    before any plain JSON, or None for plain JSON."""
    for media, params in _media_types(accept):
        if media not in ("application/json", "*/*", "application/*"):
            continue
        if "as" not in params:
            return None
        if params.get("as") == kind and params.get("g") == group and \
                params.get("v") in versions:
            return params["v"]
    return None


# ---------------------------------------------------------------- discovery, OpenAPI

_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def _api_group(group: str, versions: list[str]) -> dict:
    listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
    return {"name": group, "versions": listed, "preferredVersion": listed[0]}


def _digest(doc: dict) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32].upper()


def _query_param(name: str, text: str) -> dict:
    return {"name": name, "in": "query", "description": text,
            "schema": {"type": "string", "uniqueItems": True}}


_WRITE_PARAMS = [
    _query_param("dryRun", "When present, modifications are not persisted."),
    _query_param("fieldManager", "The name of the actor or entity making the change."),
    _query_param("fieldValidation", "What to do with unknown or duplicate fields in the "
                 "request body: Ignore, Warn (the default) or Strict (fail the request)."),
]


def _openapi_document(kind: Kind, schema: dict | None) -> dict:
    """One custom resource version's OpenAPI v3 document, shaped as the real
    server publishes it for a CRD (no strategic merge patch)."""
    gvk = {"group": kind.group, "version": kind.version, "kind": kind.kind}
    name = ".".join([*reversed(kind.group.split(".")), kind.version, kind.kind])
    ref = {"$ref": f"#/components/schemas/{name}"}
    json_body = {"content": {"application/json": {"schema": ref}}, "required": True}
    patch_body = {"content": {t: {"schema": {"type": "object"}} for t in (
        "application/json-patch+json", "application/merge-patch+json",
        "application/apply-patch+yaml")}, "required": True}

    def op(action: str, what: str, body=None, params=(), result=ref) -> dict:
        out = {"operationId": f"{action}{kind.kind}{what}",
               "parameters": list(params),
               "responses": {"200": {"description": "OK", "content": {
                   "application/json": {"schema": result}}}},
               "x-kubernetes-action": action, "x-kubernetes-group-version-kind": gvk}
        if body:
            out["requestBody"] = body
        return out

    name_param = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    ns_param = {"name": "namespace", "in": "path", "required": True,
                "schema": {"type": "string"}}
    list_ref = {"$ref": f"#/components/schemas/{name}List"}
    base = f"/apis/{kind.group}/{kind.version}/namespaces/{{namespace}}/{kind.plural}"
    item = {"get": op("get", ""), "put": op("put", "", json_body, _WRITE_PARAMS),
            "patch": op("patch", "", patch_body, [
                *_WRITE_PARAMS, _query_param("force", "Force an apply.")]),
            "delete": op("delete", ""), "parameters": [name_param, ns_param]}
    paths = {
        f"/apis/{kind.group}/{kind.version}/{kind.plural}": {
            "get": op("list", "ForAllNamespaces", result=list_ref)},
        base: {"get": op("list", "", result=list_ref),
               "post": op("post", "", json_body, _WRITE_PARAMS),
               "delete": op("deletecollection", ""), "parameters": [ns_param]},
        base + "/{name}": item,
    }
    if kind.status:
        paths[base + "/{name}/status"] = {
            "get": op("get", "Status"), "put": op("put", "Status", json_body, _WRITE_PARAMS),
            "patch": op("patch", "Status", patch_body, _WRITE_PARAMS),
            "parameters": [name_param, ns_param]}
    resource = copy.deepcopy(schema) if schema else {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True}
    resource["x-kubernetes-group-version-kind"] = [gvk]
    listing = {"type": "object", "required": ["items"], "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "metadata": {"type": "object"}, "items": {"type": "array", "items": ref}},
        "x-kubernetes-group-version-kind": [{**gvk, "kind": f"{kind.kind}List"}]}
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes CRD Swagger",
                                         "version": "v0.1.0"},
            "paths": paths,
            "components": {"schemas": {name: resource, f"{name}List": listing}}}


# ---------------------------------------------------------------- the server

_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_PATH = re.compile(r"^/(?:api/(?P<v>v1)|apis/(?P<g>[^/]+)/(?P<gv>[^/]+))"
                   r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)"
                   r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$")
_SERVER_META = ("uid", "creationTimestamp", "generation", "deletionTimestamp",
                "deletionGracePeriodSeconds", "namespace", "name")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "FakeKubeAPI/1"

    def log_message(self, *args):
        pass

    def setup(self):
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms stalls
        self.server.api._connections.add(self.connection)

    def finish(self):
        self.server.api._connections.discard(self.connection)
        super().finish()

    def do_GET(self):
        self.server.api._handle(self, self.command)

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET


class FakeKubeAPI:
    def __init__(self, history: int = 1000, crd: Path | None = CRD_PATH,
                 bookmark_interval: float = 1.0):
        """`crd`: the CustomResourceDefinition whose resources are served (None: none)."""
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self.kinds: dict[tuple[str, str, str], Kind] = {
            (k.group, k.version, k.plural): k for k in BUILTIN_KINDS}
        # Every version of a custom resource shares one store, keyed by its "home"
        # Kind; `_storage` says at which version a write is stored now.
        self._home: dict[Kind, Kind] = {k: k for k in BUILTIN_KINDS}
        self._storage: dict[Kind, Kind] = {}
        self._schemas: dict[Kind, dict | None] = {}
        if crd is not None:
            served, schemas, storage = crd_kinds(load_crd(crd))
            home = next(k for k in served if k.version == storage)
            for k in served:
                self.kinds[(k.group, k.version, k.plural)] = k
                self._home[k], self._schemas[k] = home, schemas[k.version]
            self._storage[home] = home
        # in this order garbage collection visits dependents: custom resources first
        self._store: dict[Kind, dict[tuple[str, str], dict]] = {
            k: {} for k in [*self._storage, *BUILTIN_KINDS]}
        self._local = threading.local()  # per request: the Warning headers to send
        self._rv = 1000
        self._history: deque = deque()  # (rv, kind, type, obj, previous)
        self._history_max = history
        self._oldest = self._rv  # every event after this version is retained
        self._epoch = 0
        self._watching = 0
        self._stopping = False
        self._failures: list[tuple[str, re.Pattern, int]] = []
        self._cut_off: set[str] = set()  # lease holders whose writes fail
        self._connections: set[socket.socket] = set()
        self.bookmark_interval = bookmark_interval
        self.events: list[Write] = []
        self.requests: list[Request] = []
        self._server: ThreadingHTTPServer | None = None

    # ---- lifecycle
    def start(self) -> Self:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.api = self
        threading.Thread(target=self._server.serve_forever, args=(0.05,),
                         name="fake-kube-api", daemon=True).start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._server:
            self._server.shutdown()
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._server.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def kubeconfig(self, path: Path) -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "fake", "cluster": {"server": self.url,
                                                      "insecure-skip-tls-verify": True}}],
            "users": [{"name": "fake", "user": {"token": TOKEN}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": "default"}}],
            "current-context": "fake"}))
        return path

    def client_configuration(self):
        from kubernetes import client
        return client.Configuration(host=self.url, api_key={"authorization": f"Bearer {TOKEN}"})

    # ---- test hooks
    def objects(self, plural: str) -> list[dict]:
        """The stored objects of `plural` (custom resources as stored, at the
        version each was written in)."""
        kind = next(k for k in self._store if k.plural == plural)
        with self._lock:
            return [copy.deepcopy(o) for _, o in sorted(self._store[kind].items())]

    def set_storage_version(self, version: str) -> None:
        """As a CRD update moving `storage: true` to `version` does: later writes
        of the custom resource are stored at `version`; stored objects keep theirs
        until written again."""
        with self._lock:
            home = next(iter(self._storage))
            self._storage[home] = self.kinds[(home.group, version, home.plural)]

    def fail_next(self, method: str, path_regex: str, code: int) -> None:
        """The next `method` request whose path matches gets a `code` Status error."""
        with self._lock:
            self._failures.append((method.upper(), re.compile(path_regex), code))

    def cut_off(self, holder: str) -> None:
        """Until `reconnect(holder)`, every Lease write naming `holder` as its
        holderIdentity fails with 503: a candidate that can no longer reach
        the API server to renew (its reads still answer)."""
        with self._lock:
            self._cut_off.add(holder)

    def reconnect(self, holder: str) -> None:
        with self._lock:
            self._cut_off.discard(holder)

    def compact(self) -> None:
        """Forget the watch history, as an etcd compaction does."""
        with self._cond:
            self._history.clear()
            self._oldest = self._rv
            self._cond.notify_all()

    def drop_watches(self) -> None:
        """End every open watch stream (cleanly, as a server-side timeout does)."""
        with self._cond:
            self._epoch += 1
            self._cond.notify_all()

    @property
    def watching(self) -> int:
        """How many watch streams are open now."""
        return self._watching

    def wait_for_watches(self, count: int, timeout: float = 5.0) -> bool:
        """Block until at least `count` watch streams are open (e.g. a controller started)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._watching >= count, timeout)

    @property
    def resource_version(self) -> str:
        return str(self._rv)

    # ---- HTTP
    def _handle(self, h: _Handler, method: str) -> None:
        url = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        raw = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        accept = h.headers.get("Accept", "")
        self._local.warnings = []
        ctype = "application/json"
        with self._lock:
            self.requests.append(Request(method, url.path, query,
                                         h.headers.get("Content-Type", "")))
        try:
            self._inject(method, url.path)
            self._refuse_cut_off(method, url.path, raw)
            if url.path == "/version":
                return self._send(h, 200, {"major": "1", "minor": "30",
                                           "gitVersion": "v1.30.0-fake"})
            if method == "GET" and (found := self._discovery(url.path, accept)):
                return self._send(h, 200, found[1], found[0])
            if method == "GET" and url.path.startswith("/openapi/"):
                return self._send(h, 200, self._openapi(url.path))
            m = _PATH.match(url.path)
            kind = m and self.kinds.get((m["g"] or "", m["gv"] or m["v"], m["plural"]))
            if not kind or (m["sub"] and m["sub"] != "status") or (m["name"] and not m["ns"]):
                raise ApiError(404, "the server could not find the requested resource",
                               "NotFound", {})
            if m["sub"] and not kind.status:
                raise ApiError(404, "the server could not find the requested resource",
                               "NotFound", {})
            if kind.deprecation:
                self._warn(kind.deprecation)
            ns, name, sub = m["ns"], m["name"], m["sub"]
            # kubectl get asks for a Table; custom resources print their columns
            as_table = kind.custom and method == "GET" and _negotiate(
                accept, "Table", "meta.k8s.io", ("v1", "v1beta1"))
            if method == "GET" and not name and query.get("watch") in ("true", "1", "True"):
                return self._watch(h, kind, ns, query, as_table)
            code, body = self._dispatch(method, kind, ns, name, sub, query, raw,
                                        h.headers.get("Content-Type", ""), url.path)
            if code < 300:
                body = self._present(kind, body)
                if as_table:
                    items = body["items"] if "items" in body else [body]
                    body = table(kind, items, body["metadata"].get("resourceVersion", ""),
                                 as_table, query.get("includeObject", "Metadata"))
                    ctype = f"application/json;as=Table;v={as_table};g=meta.k8s.io"
        except ApiError as e:
            code, body = e.code, e.status()
        except Exception as e:  # noqa: BLE001 - a bug in the double answers 500, as a server
            code, body = 500, ApiError(500, f"fake API server error: {e!r}").status()
        self._send(h, code, body, ctype)

    def _send(self, h: _Handler, code: int, body: dict,
              ctype: str = "application/json") -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(data)))
        self._send_warnings(h)
        h.end_headers()
        h.wfile.write(data)

    def _send_warnings(self, h: _Handler) -> None:
        for text in getattr(self._local, "warnings", ()):
            escaped = text.replace("\\", "\\\\").replace('"', '\\"')
            h.send_header("Warning", f'299 - "{escaped}"')

    def _warn(self, text: str) -> None:
        if text not in self._local.warnings:
            self._local.warnings.append(text)

    # ---- discovery and OpenAPI
    def _groups(self) -> dict[str, list[str]]:
        """Group -> its versions, the preferred first (built-in groups first)."""
        groups: dict[str, set[str]] = {}
        for k in self.kinds.values():
            groups.setdefault(k.group, set()).add(k.version)
        return {g: sorted(vs, key=version_priority) for g, vs in groups.items()}

    def _discovery(self, path: str, accept: str) -> tuple[str, dict] | None:
        """(content type, document) for a discovery path, else None. The
        aggregated form (apidiscovery.k8s.io v2 or v2beta1) when the Accept
        header asks for it first, else the legacy documents."""
        groups = self._groups()
        if path in ("/api", "/apis"):
            aggregated = _negotiate(accept, "APIGroupDiscoveryList", "apidiscovery.k8s.io",
                                    ("v2", "v2beta1"))
            if aggregated:
                items = [self._group_discovery(g, vs) for g, vs in groups.items()
                         if (g == "") == (path == "/api")]
                return (f"application/json;g=apidiscovery.k8s.io;v={aggregated};"
                        "as=APIGroupDiscoveryList",
                        {"kind": "APIGroupDiscoveryList",
                         "apiVersion": f"apidiscovery.k8s.io/{aggregated}", "metadata": {},
                         "items": items})
            if path == "/api":
                host = "%s:%s" % self._server.server_address[:2]
                return "application/json", {
                    "kind": "APIVersions", "versions": groups[""],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0",
                                                    "serverAddress": host}]}
            return "application/json", {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                _api_group(g, vs) for g, vs in groups.items() if g]}
        if path == "/api/v1":
            return "application/json", self._resource_list("", "v1")
        m = re.fullmatch(r"/apis/([^/]+)(?:/([^/]+))?", path)
        if m and m[1] in groups and m[1]:
            if m[2] is None:
                return "application/json", {"kind": "APIGroup", "apiVersion": "v1",
                                            **_api_group(m[1], groups[m[1]])}
            if m[2] in groups[m[1]]:
                return "application/json", self._resource_list(m[1], m[2])
        return None

    def _resource_list(self, group: str, version: str) -> dict:
        resources = []
        for k in self.kinds.values():
            if (k.group, k.version) != (group, version):
                continue
            entry = {"name": k.plural, "singularName": k.singular, "namespaced": True,
                     "kind": k.kind, "verbs": _VERBS}
            entry.update({key: list(value) for key, value in (
                ("shortNames", k.short_names), ("categories", k.categories)) if value})
            resources.append(entry)
            if k.status:
                resources.append({"name": f"{k.plural}/status", "singularName": "",
                                  "namespaced": True, "kind": k.kind,
                                  "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": resources}

    def _group_discovery(self, group: str, versions: list[str]) -> dict:
        out = []
        for version in versions:
            resources = []
            for k in self.kinds.values():
                if (k.group, k.version) != (group, version):
                    continue
                gvk = {"group": k.group, "version": k.version, "kind": k.kind}
                entry = {"resource": k.plural, "responseKind": gvk, "scope": "Namespaced",
                         "singularResource": k.singular, "verbs": _VERBS}
                entry.update({key: list(value) for key, value in (
                    ("shortNames", k.short_names), ("categories", k.categories)) if value})
                if k.status:
                    entry["subresources"] = [{"subresource": "status", "responseKind": gvk,
                                              "verbs": ["get", "patch", "update"]}]
                resources.append(entry)
            out.append({"version": version, "resources": resources, "freshness": "Current"})
        return {"metadata": {"name": group} if group else {}, "versions": out}

    def _openapi(self, path: str) -> dict:
        """OpenAPI v3 for the custom resource's versions: the index at
        /openapi/v3 and one document per group version (paths with their
        operations, parameters and group-version-kind; the version's schema)."""
        docs = {f"apis/{k.group}/{k.version}": k for k in self.kinds.values() if k.custom}
        if path == "/openapi/v3":
            return {"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash="
                                   + _digest(_openapi_document(k, self._schemas.get(k)))}
                              for gv, k in docs.items()}}
        kind = docs.get(path.removeprefix("/openapi/v3/"))
        if not kind:
            raise ApiError(404, "the server could not find the requested resource",
                           "NotFound", {})
        return _openapi_document(kind, self._schemas.get(kind))

    def _refuse_cut_off(self, method: str, path: str, raw: bytes) -> None:
        if method not in ("POST", "PUT", "PATCH") or "/leases" not in path or not raw:
            return
        try:
            holder = (json.loads(raw).get("spec") or {}).get("holderIdentity")
        except ValueError:
            return
        with self._lock:
            if holder in self._cut_off:
                raise ApiError(503, f"{holder} cannot reach the API server", "ServiceUnavailable")

    def _inject(self, method: str, path: str) -> None:
        with self._lock:
            for i, (m, rx, code) in enumerate(self._failures):
                if m == method and rx.search(path):
                    del self._failures[i]
                    raise ApiError(code, f"injected failure {code} for {method} {path}")

    def _dispatch(self, method, kind, ns, name, sub, query, raw, ctype, path):
        try:
            # as Go's decoding into unstructured: an integral number (2.0) is an integer
            body = json.loads(raw, parse_float=_json_number) if raw else None
        except ValueError as e:
            raise ApiError(400, f"error decoding request body: {e}") from e
        self._local.directive = query.get("fieldValidation") or "Warn"
        with self._cond:
            if method == "GET":
                return 200, self._get(kind, ns, name) if name else self._list(kind, ns, query)
            if method == "POST" and not name and ns:
                return 201, self._create(kind, ns, body or {}, path)
            if method == "PUT" and name:
                return 200, self._replace(kind, ns, name, sub, body or {}, path)
            if method == "PATCH" and name:
                return 200, self._patch(kind, ns, name, sub, body, ctype.split(";")[0], path)
            if method == "DELETE" and name and not sub:
                return self._delete_request(kind, ns, name, {**(body or {}), **query}, path)
            if method == "DELETE" and ns and not name:
                items = []
                for obj in self._select(kind, ns, query):
                    name = obj["metadata"]["name"]
                    if (ns, name) in self._objs(kind):  # GC may have taken it already
                        items.append(self._delete_request(kind, ns, name, query,
                                                          f"{path}/{name}")[1])
                return 200, {"kind": f"{kind.kind}List", "apiVersion": kind.api_version,
                             "metadata": {"resourceVersion": str(self._rv)}, "items": items}
        raise ApiError(405, "the server does not allow this method on the requested resource",
                       "MethodNotAllowed", {})

    # ---- verbs (lock held)
    def _objs(self, kind: Kind) -> dict[tuple[str, str], dict]:
        return self._store[self._home[kind]]

    def _get(self, kind: Kind, ns: str, name: str) -> dict:
        obj = self._objs(kind).get((ns, name))
        if obj is None:
            raise _not_found(kind, name)
        return obj

    def _select(self, kind: Kind, ns: str | None, query: dict) -> list[dict]:
        try:
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = parse_field_selector(query.get("fieldSelector", ""), kind.plural)
        except ValueError as e:
            raise ApiError(400, str(e)) from e
        return [o for (ons, _), o in sorted(self._objs(kind).items())
                if (ns is None or ons == ns) and labels(o["metadata"].get("labels"))
                and fields(o)]

    def _list(self, kind: Kind, ns: str | None, query: dict) -> dict:
        items = self._select(kind, ns, query)
        if not kind.custom:  # built-in lists carry no per-item kind/apiVersion
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")}
                     for o in items]
        return {"kind": f"{kind.kind}List", "apiVersion": kind.api_version,
                "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _check_identity(self, kind: Kind, ns: str, body: dict, name: str | None = None):
        if body.get("kind") not in (None, kind.kind) or \
                body.get("apiVersion") not in (None, kind.api_version):
            raise ApiError(400, f"the API version in the data ({body.get('apiVersion')}) does "
                           f"not match the expected API version ({kind.api_version})")
        meta = body.get("metadata") or {}
        if meta.get("namespace") not in (None, "", ns):
            raise ApiError(400, "the namespace of the provided object does not match the "
                           "namespace sent on the request")
        if name is not None and meta.get("name") not in (None, name):
            raise ApiError(400, f"the name of the object ({meta.get('name')}) does not match "
                           f"the name on the URL ({name})")

    def _create(self, kind: Kind, ns: str, body: dict, path: str) -> dict:
        self._check_identity(kind, ns, body)
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(
                random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        name = meta.get("name") or ""
        if not name:
            raise _invalid(kind, "", [("metadata.name", "FieldValueRequired",
                                       "Required value: name or generateName is required")])
        if not _NAME.fullmatch(name) or len(name) > 253:
            raise _invalid(kind, name, [("metadata.name", "FieldValueInvalid",
                                         (f'Invalid value: "{name}": a lowercase RFC 1123 '
                                         "subdomain must consist of lower case alphanumeric "
                                         "characters, '-' or '.'"))])
        if (ns, name) in self._objs(kind):
            raise ApiError(409, f'{kind.resource} "{name}" already exists', "AlreadyExists",
                           {"name": name, "group": kind.group, "kind": kind.plural})
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(key, None)
        meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
        if kind.generation:
            meta["generation"] = 1
        if kind.status:
            obj.pop("status", None)
            if not kind.custom:  # Go's zero values: DaemonSetStatus has required counters
                obj["status"] = copy.deepcopy(_INITIAL_STATUS.get(kind.plural, {}))
        obj = self._admit(kind, obj)
        return self._write(kind, "ADDED", obj, None, "POST", path)

    def _replace(self, kind, ns, name, sub, body, path) -> dict:
        old = self._get(kind, ns, name)
        self._check_identity(kind, ns, body, name)
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if not rv and kind.custom:
            raise _invalid(kind, name, [("metadata.resourceVersion", "FieldValueInvalid",
                                         "Invalid value: 0x0: must be specified for an update")])
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise _conflict(kind, name, STALE)
        return self._update(kind, old, copy.deepcopy(body), sub, "PUT", path)

    def _patch(self, kind, ns, name, sub, patch, ctype, path) -> dict:
        old = self._get(kind, ns, name)
        current = copy.deepcopy(self._convert(kind, old))  # patched at the request version
        if ctype == "application/merge-patch+json":
            if not isinstance(patch, dict):
                raise ApiError(400, "merge patch must be a JSON object")
            new = merge_patch(current, patch)
        elif ctype == "application/strategic-merge-patch+json":
            if kind.custom:
                raise ApiError(415, "the body of the request was in an unknown format - "
                               "accepted media types include: application/json-patch+json, "
                               "application/merge-patch+json, application/apply-patch+yaml")
            if not isinstance(patch, dict):
                raise ApiError(400, "strategic merge patch must be a JSON object")
            new = strategic_merge_patch(current, patch)
        elif ctype == "application/json-patch+json":
            try:
                new = json_patch(current, patch)
            except TypeError as e:
                raise ApiError(400, str(e)) from e
            except ValueError as e:
                raise ApiError(422, str(e)) from e
        else:
            raise ApiError(415, f"the body of the request was in an unknown format - "
                           f"accepted media types include: application/json-patch+json, "
                           f"application/merge-patch+json"
                           f"{'' if kind.custom else ', application/strategic-merge-patch+json'}")
        if not isinstance(new, dict):
            raise ApiError(422, "patched object is not a JSON object")
        self._check_identity(kind, ns, new, name)
        if (new.get("metadata") or {}).get("resourceVersion") != old["metadata"]["resourceVersion"]:
            raise _conflict(kind, name, STALE)
        return self._update(kind, old, new, sub, "PATCH", path)

    def _update(self, kind: Kind, old: dict, new: dict, sub: str | None, verb, path) -> dict:
        name, seen = old["metadata"]["name"], self._convert(kind, old)
        if sub == "status":
            body_status = new.get("status")
            new = copy.deepcopy(seen)
            new.pop("status", None)
            if body_status is not None:
                new["status"] = body_status
        else:
            meta = new.setdefault("metadata", {})
            for key in _SERVER_META:
                meta.pop(key, None)
                if key in old["metadata"]:
                    meta[key] = old["metadata"][key]
            if kind.status:
                new.pop("status", None)
                if "status" in seen:
                    new["status"] = copy.deepcopy(seen["status"])
            if old["metadata"].get("deletionTimestamp"):
                added = set(meta.get("finalizers") or []) - set(
                    old["metadata"].get("finalizers") or [])
                if added:
                    raise _invalid(kind, name, [("metadata.finalizers", "FieldValueForbidden",
                                                 ("Forbidden: no new finalizers can be added if "
                                                 "the object is being deleted"))])
        new.setdefault("metadata", {})["resourceVersion"] = old["metadata"]["resourceVersion"]
        new = self._admit(kind, new, seen)
        if kind.generation and _spec_of(new) != _spec_of(old):
            new["metadata"]["generation"] = old["metadata"].get("generation", 0) + 1
        if new == old:  # the real server skips no-op writes
            self.events.append(Write(verb, path, old["metadata"]["resourceVersion"]))
            return old
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return self._remove(kind, old, verb, path)
        return self._write(kind, "MODIFIED", new, old, verb, path)

    def _admit(self, kind: Kind, obj: dict, old: dict | None = None) -> dict:
        """A written object as stored: at the request version, unknown fields
        reported (fieldValidation) and pruned, defaults filled and the schema
        checked (on an update, `old` at the request version: an error in a part
        the update leaves unchanged is let through, as validation ratcheting,
        on by default since Kubernetes 1.30, does); then converted to the storage version (conversion strategy
        None: only apiVersion changes) and pruned by that version's schema."""
        obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
        _default_builtin(kind, obj)
        if not kind.custom:
            return obj
        unknown: list[str] = []
        obj = self._coerce(kind, obj, unknown)
        directive = getattr(self._local, "directive", "Warn")
        if unknown and directive == "Strict":
            raise ApiError(400, f'{kind.kind} in version "{kind.version}" cannot be handled '
                           f"as a {kind.kind}: strict decoding error: "
                           + ", ".join(f'unknown field "{f}"' for f in unknown), "BadRequest")
        if directive == "Warn":
            for field in unknown:
                self._warn(f'unknown field "{field}"')
        if self._schemas.get(kind):
            errs: list = []
            validate(obj, self._schemas[kind], "", errs)
            if old is not None:  # ratcheting: what the update leaves as it was may stay
                errs = [e for e in errs if not _unchanged(old, obj, e[0])]
            if errs:
                raise _invalid(kind, obj["metadata"].get("name", ""), errs)
        return self._convert(self._storage[self._home[kind]], obj)

    def _coerce(self, kind: Kind, obj: dict, unknown: list | None = None) -> dict:
        """`obj` pruned and defaulted by `kind`'s schema (metadata kept as it is)."""
        schema = self._schemas.get(kind)
        if not schema:
            return obj
        meta = obj.get("metadata")
        obj = prune_and_default({k: v for k, v in obj.items() if k != "metadata"}, schema,
                                unknown)
        obj["metadata"] = meta
        return obj

    def _convert(self, kind: Kind, obj: dict) -> dict:
        """A custom resource at `kind`'s version: apiVersion set, then pruned and
        defaulted by that version's schema (as the real converter does); the
        object itself when it is at that version already."""
        if not kind.custom or obj.get("apiVersion") == kind.api_version:
            return obj
        return self._coerce(kind, {**copy.deepcopy(obj), "apiVersion": kind.api_version})

    def _present(self, kind: Kind, body: dict) -> dict:
        """A response body (object or list) at the request's version."""
        if not kind.custom:
            return body
        if "items" in body and body.get("kind", "").endswith("List"):
            return {**body, "apiVersion": kind.api_version,
                    "items": [self._convert(kind, o) for o in body["items"]]}
        return self._convert(kind, body) if body.get("kind") == kind.kind else body

    def _delete_request(self, kind, ns, name, opts: dict, path) -> tuple[int, dict]:
        obj = self._get(kind, ns, name)
        pre = opts.get("preconditions") or {}
        for field in ("uid", "resourceVersion"):
            want = pre.get(field)
            if want and want != obj["metadata"].get(field):
                raise _conflict(kind, name, f"Precondition failed: {field} in precondition: "
                                f"{want}, {field} in object meta: {obj['metadata'].get(field)}")
        result, gone = self._delete(kind, obj, "DELETE", path,
                                    opts.get("propagationPolicy") == "Orphan")
        # The real registry answers a deleted Service or Pod with the object itself
        # (their stores set ReturnDeletedObject); other built-in kinds with a Status.
        if gone and not kind.custom and kind.plural not in ("services", "pods"):
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                         "status": "Success", "details": {"name": name, "group": kind.group,
                                                          "kind": kind.plural,
                                                          "uid": obj["metadata"]["uid"]}}
        return 200, result

    def _delete(self, kind: Kind, obj: dict, verb: str, path: str, orphan=False):
        uid = obj["metadata"]["uid"]
        if orphan:
            for dkind, dep in self._dependents(uid, obj["metadata"]["namespace"]):
                new = copy.deepcopy(dep)
                new["metadata"]["ownerReferences"] = [
                    r for r in dep["metadata"]["ownerReferences"] if r.get("uid") != uid]
                self._write(dkind, "MODIFIED", new, dep, "gc", _path_of(dkind, dep))
        if obj["metadata"].get("finalizers"):
            if obj["metadata"].get("deletionTimestamp"):
                return obj, False
            new = copy.deepcopy(obj)
            new["metadata"].update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
            if new["metadata"].get("generation"):
                new["metadata"]["generation"] += 1
            return self._write(kind, "MODIFIED", new, obj, verb, path), False
        return self._remove(kind, obj, verb, path), True

    def _remove(self, kind: Kind, obj: dict, verb: str, path: str) -> dict:
        gone = self._write(kind, "DELETED", copy.deepcopy(obj), obj, verb, path)
        ns, uid = obj["metadata"]["namespace"], obj["metadata"]["uid"]
        live = {o["metadata"]["uid"] for s in self._store.values() for o in s.values()}
        for dkind, dep in self._dependents(uid, ns):
            if not any(r.get("uid") in live for r in dep["metadata"]["ownerReferences"]):
                current = self._store[dkind].get((ns, dep["metadata"]["name"]))
                if current is not None:
                    self._delete(dkind, current, "gc", _path_of(dkind, current))
        return gone

    def _dependents(self, uid: str, ns: str):
        return [(k, o) for k, s in self._store.items() for (ons, _), o in sorted(s.items())
                if ons == ns and any(r.get("uid") == uid
                                     for r in o["metadata"].get("ownerReferences") or [])]

    def _write(self, kind: Kind, etype: str, obj: dict, previous, verb: str, path: str) -> dict:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if etype == "DELETED":
            self._objs(kind).pop(key, None)
        else:
            self._objs(kind)[key] = obj
        if len(self._history) >= self._history_max:
            self._oldest = self._history.popleft()[0]
        self._history.append((self._rv, self._home[kind], etype, obj, previous))
        self.events.append(Write(verb, path, str(self._rv)))
        self._cond.notify_all()
        return obj

    # ---- watch
    def _watch(self, h: _Handler, kind: Kind, ns: str | None, query: dict,
               as_table: str | None = None) -> None:
        home = self._home[kind]
        try:
            labels = parse_label_selector(query.get("labelSelector", ""))
            fields = parse_field_selector(query.get("fieldSelector", ""), kind.plural)
            timeout = float(query.get("timeoutSeconds") or 1800)
            since = int(query.get("resourceVersion") or 0)
        except ValueError as e:
            raise ApiError(400, str(e)) from e

        def selected(obj):
            return (obj is not None and (ns is None or obj["metadata"]["namespace"] == ns)
                    and labels(obj["metadata"].get("labels")) and fields(obj))

        bookmarks = query.get("allowWatchBookmarks") in ("true", "1", "True")
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + self.bookmark_interval
        with self._cond:
            epoch, self._watching = self._epoch, self._watching + 1
            self._cond.notify_all()
            if since == 0:  # "0" or absent: the current state as ADDED events, then changes
                pending, last = [("ADDED", o) for o in self._select(kind, ns, query)], self._rv
            else:
                pending, last = [], since
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Transfer-Encoding", "chunked")
            self._send_warnings(h)
            h.end_headers()
            while True:
                for etype, obj in pending:
                    if etype != "ERROR":
                        obj = self._convert(kind, obj)
                        if as_table:  # each event a Table of its one row
                            obj = table(kind, [obj], obj["metadata"]["resourceVersion"],
                                        as_table, query.get("includeObject", "Metadata"))
                    self._chunk(h, {"type": etype, "object": obj})
                if pending and pending[-1][0] == "ERROR":
                    break
                if bookmarks and time.monotonic() >= next_bookmark:
                    self._chunk(h, {"type": "BOOKMARK", "object": {
                        "kind": kind.kind, "apiVersion": kind.api_version,
                        "metadata": {"resourceVersion": str(last)}}})
                    next_bookmark = time.monotonic() + self.bookmark_interval
                with self._cond:
                    pending = []
                    while self._rv <= last and last >= self._oldest:
                        wait = min(deadline, next_bookmark if bookmarks else deadline,
                                   time.monotonic() + 0.25) - time.monotonic()
                        if (self._stopping or self._epoch != epoch or wait <= 0
                                or _peer_closed(h.connection)):
                            break
                        self._cond.wait(wait)
                    if (self._stopping or self._epoch != epoch
                            or time.monotonic() >= deadline or _peer_closed(h.connection)):
                        break
                    if last < self._oldest:  # asked for, or fell behind, compacted history
                        pending = [("ERROR", ApiError(
                            410, f"too old resource version: {last} ({self._oldest})",
                            "Expired").status())]
                        continue
                    for rv, k, etype, obj, prev in self._history:
                        if rv <= last or k is not home:
                            continue
                        now_in, was_in = selected(obj), selected(prev)
                        if etype == "MODIFIED" and now_in != was_in:  # entered/left selection
                            etype = "ADDED" if now_in else "DELETED"
                        if now_in or (etype == "DELETED" and was_in):
                            pending.append((etype, obj))
                    last = max(last, self._rv)
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            h.close_connection = True
        finally:
            with self._cond:
                self._watching -= 1
                self._cond.notify_all()

    @staticmethod
    def _chunk(h: _Handler, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))


def _json_number(text: str) -> int | float:
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2 ** 63 else value


def _peer_closed(conn: socket.socket) -> bool:
    """True once the client has hung up (a readable socket with nothing to read)."""
    try:
        return bool(select.select([conn], [], [], 0)[0]) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


_INITIAL_STATUS = {"services": {"loadBalancer": {}}, "daemonsets": {
    "currentNumberScheduled": 0, "numberMisscheduled": 0, "desiredNumberScheduled": 0,
    "numberReady": 0}}
_POD_DEFAULTS = {"restartPolicy": "Always", "terminationGracePeriodSeconds": 30,
                 "dnsPolicy": "ClusterFirst", "securityContext": {},
                 "schedulerName": "default-scheduler"}
_WORKLOAD_DEFAULTS = {
    "deployments": {"replicas": 1, "revisionHistoryLimit": 10, "progressDeadlineSeconds": 600,
                    "strategy": {"type": "RollingUpdate",
                                 "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"}}},
    "daemonsets": {"revisionHistoryLimit": 10,
                   "updateStrategy": {"type": "RollingUpdate",
                                      "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}}}


def _fill(obj: dict, defaults: dict) -> None:
    for key, value in defaults.items():
        if key not in obj:
            obj[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(obj[key], dict):
            _fill(obj[key], value)


def _default_builtin(kind: Kind, obj: dict) -> None:
    """The server-side defaults of built-in kinds that a spec comparison would trip over."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or kind.custom:
        return
    if kind.plural in _WORKLOAD_DEFAULTS:
        _fill(spec, _WORKLOAD_DEFAULTS[kind.plural])
        pod = spec.setdefault("template", {}).setdefault("spec", {})
        _fill(pod, _POD_DEFAULTS)
        for c in pod.get("containers", []) + pod.get("initContainers", []):
            tag = c.get("image", "").rsplit("/", 1)[-1]
            _fill(c, {"terminationMessagePath": "/dev/termination-log",
                      "terminationMessagePolicy": "File", "resources": {},
                      "imagePullPolicy": "IfNotPresent" if ":" in tag and
                      not tag.endswith(":latest") else "Always"})
            for port in c.get("ports", []):
                port.setdefault("protocol", "TCP")
    elif kind.plural == "services":
        ip = "10.96.%d.%d" % divmod(zlib.crc32(obj["metadata"]["name"].encode()) % 65000 + 10, 256)
        _fill(spec, {"type": "ClusterIP", "sessionAffinity": "None", "clusterIP": ip,
                     "clusterIPs": [ip], "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                     "internalTrafficPolicy": "Cluster"})
        for port in spec.get("ports", []):
            _fill(port, {"protocol": "TCP", "targetPort": port.get("port")})


def _spec_of(obj: dict) -> dict:
    return {k: v for k, v in obj.items()
            if k not in ("metadata", "status", "apiVersion", "kind")}


def _path_of(kind: Kind, obj: dict) -> str:
    base = f"/apis/{kind.group}/{kind.version}" if kind.group else "/api/v1"
    return f"{base}/namespaces/{obj['metadata']['namespace']}/{kind.plural}/" \
           f"{obj['metadata']['name']}"
