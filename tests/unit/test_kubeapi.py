"""The Kubernetes API double, driven through the real official `kubernetes` client."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from kubernetes import client, config, watch

from tests.kubeapi import FakeKubeAPI, go_text, human_duration, jsonpath
from tiered.rollout.wire import API_GROUP, API_VERSION

NS = "default"
GROUP, VERSION, PLURAL = API_GROUP, API_VERSION, "tieredmodels"
CR = (GROUP, VERSION, NS, PLURAL)


@pytest.fixture
def api():
    with FakeKubeAPI() as server:
        yield server


@pytest.fixture
def k8s(api):
    with client.ApiClient(api.client_configuration()) as api_client:
        yield api_client


def tiered_model(name="m", uri="model.onnx", **meta):
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TieredModel",
            "metadata": {"name": name, **meta},
            "spec": {"artifact": {"uri": uri}, "tiers": {"edge": {"replicas": 2}},
                     "rollout": {"stages": [{"name": "all", "weights": {"edge": 100}}]}}}


def config_map(name, **meta):
    return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, **meta), data={"k": "v"})


def deployment(name, owner=None, replicas=1):
    refs = [client.V1OwnerReference(api_version=f"{GROUP}/{VERSION}", kind="TieredModel",
                                    name=owner["metadata"]["name"],
                                    uid=owner["metadata"]["uid"])] if owner else None
    container = client.V1Container(name="agent", image="agent:1",
                                   env=[client.V1EnvVar(name="A", value="1")])
    return client.V1Deployment(
        metadata=client.V1ObjectMeta(name=name, owner_references=refs),
        spec=client.V1DeploymentSpec(
            replicas=replicas, selector=client.V1LabelSelector(match_labels={"app": name}),
            template=client.V1PodTemplateSpec(
                metadata=client.V1ObjectMeta(labels={"app": name}),
                spec=client.V1PodSpec(containers=[container]))))


def take(n, func, *args, **kwargs) -> list[dict]:
    """The first n watch events (the stream is then closed by the client)."""
    w, events = watch.Watch(), []
    for event in w.stream(func, *args, timeout_seconds=5, **kwargs):
        events.append(event)
        if len(events) == n:
            w.stop()
    return events


def api_error(call, *args, **kwargs) -> tuple[int, dict]:
    with pytest.raises(client.ApiException) as info:
        call(*args, **kwargs)
    return info.value.status, json.loads(info.value.body)


def test_kubeconfig_is_accepted_by_load_kube_config(api, tmp_path):
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(api.kubeconfig(tmp_path / "kubeconfig")),
                            client_configuration=configuration)
    assert configuration.host == api.url
    with client.ApiClient(configuration) as api_client:
        core = client.CoreV1Api(api_client)
        core.create_namespaced_config_map(NS, config_map("a"))
        assert [c.metadata.name for c in core.list_namespaced_config_map(NS).items] == ["a"]


def test_create_get_list_already_exists_and_not_found(api, k8s):
    core = client.CoreV1Api(k8s)
    created = core.create_namespaced_config_map(NS, config_map("a", labels={"tier": "edge"}))
    core.create_namespaced_config_map(NS, config_map("b", labels={"tier": "dc"}))
    core.create_namespaced_config_map("other", config_map("c", labels={"tier": "edge"}))
    assert created.metadata.resource_version == "1001"
    assert created.metadata.namespace == NS and len(created.metadata.uid) == 36
    assert created.metadata.generation is None  # ConfigMaps have no spec generation
    got = core.read_namespaced_config_map("a", NS)
    assert (got.data, got.metadata.uid) == ({"k": "v"}, created.metadata.uid)

    listed = core.list_namespaced_config_map(NS)
    assert [c.metadata.name for c in listed.items] == ["a", "b"]
    assert listed.metadata.resource_version == "1003"
    by_label = core.list_config_map_for_all_namespaces(label_selector="tier=edge")
    assert [(c.metadata.namespace, c.metadata.name) for c in by_label.items] == [
        ("default", "a"), ("other", "c")]
    assert [c.metadata.name for c in core.list_namespaced_config_map(
        NS, label_selector="tier!=edge").items] == ["b"]
    assert [c.metadata.name for c in core.list_namespaced_config_map(
        NS, field_selector="metadata.name=b").items] == ["b"]

    code, status = api_error(core.create_namespaced_config_map, NS, config_map("a"))
    assert (code, status["reason"], status["details"]) == (
        409, "AlreadyExists", {"name": "a", "group": "", "kind": "configmaps"})
    assert status["message"] == 'configmaps "a" already exists'
    code, status = api_error(core.read_namespaced_config_map, "zzz", NS)
    assert (code, status["kind"], status["reason"], status["message"]) == (
        404, "Status", "NotFound", 'configmaps "zzz" not found')
    code, status = api_error(core.create_namespaced_config_map, NS,
                             client.V1ConfigMap(metadata=client.V1ObjectMeta()))
    assert (code, status["reason"], status["details"]["causes"][0]["field"]) == (
        422, "Invalid", "metadata.name")
    named = core.create_namespaced_config_map(
        NS, client.V1ConfigMap(metadata=client.V1ObjectMeta(generate_name="gen-")))
    assert named.metadata.name.startswith("gen-") and len(named.metadata.name) == 9


def test_generation_bumps_on_spec_changes_only(api, k8s):
    custom = client.CustomObjectsApi(k8s)
    obj = custom.create_namespaced_custom_object(*CR, tiered_model())
    assert obj["metadata"]["generation"] == 1
    obj["spec"]["artifact"]["uri"] = "v2.onnx"
    obj = custom.replace_namespaced_custom_object(*CR, "m", obj)
    assert obj["metadata"]["generation"] == 2
    obj = custom.patch_namespaced_custom_object(*CR, "m", {"metadata": {"labels": {"a": "b"}}})
    assert (obj["metadata"]["generation"], obj["metadata"]["labels"]) == (2, {"a": "b"})
    obj = custom.patch_namespaced_custom_object_status(*CR, "m", {"status": {"stage": "s"}})
    assert (obj["metadata"]["generation"], obj["status"]["stage"]) == (2, "s")
    # A no-op write is not a write: same resourceVersion, no watch event.
    same = custom.replace_namespaced_custom_object(*CR, "m", obj)
    assert same["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]

    apps = client.AppsV1Api(k8s)
    d = apps.create_namespaced_deployment(NS, deployment("d"))
    assert (d.metadata.generation, d.status.to_dict()["replicas"]) == (1, None)
    d = apps.patch_namespaced_deployment("d", NS, {"metadata": {"annotations": {"x": "y"}}})
    assert d.metadata.generation == 1
    d = apps.patch_namespaced_deployment("d", NS, {"spec": {"replicas": 3}})
    assert (d.metadata.generation, d.spec.replicas) == (2, 3)
    d = apps.patch_namespaced_deployment_status("d", NS, {"status": {"replicas": 3}})
    assert (d.metadata.generation, d.status.replicas) == (2, 3)
    # Built-in defaults are filled in as the real server does, so re-sending the rendered
    # (undefaulted) manifest is a no-op, not a spec change.
    container = d.spec.template.spec.containers[0]
    assert (d.spec.strategy.type, d.spec.revision_history_limit) == ("RollingUpdate", 10)
    assert (container.image_pull_policy, d.spec.template.spec.restart_policy) == (
        "IfNotPresent", "Always")
    rendered = deployment("d", replicas=3)
    rendered.metadata.annotations = {"x": "y"}
    d = apps.replace_namespaced_deployment("d", NS, rendered)
    assert d.metadata.generation == 2


def test_stale_resource_version_put_conflicts(api, k8s):
    core = client.CoreV1Api(k8s)
    first = core.create_namespaced_config_map(NS, config_map("a"))
    first.data = {"k": "second"}
    second = core.replace_namespaced_config_map("a", NS, first)
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    first.data = {"k": "lost update"}
    code, status = api_error(core.replace_namespaced_config_map, "a", NS, first)
    assert (code, status["reason"]) == (409, "Conflict")
    assert status["message"] == (
        'Operation cannot be fulfilled on configmaps "a": the object has been modified; '
        "please apply your changes to the latest version and try again")
    assert core.read_namespaced_config_map("a", NS).data == {"k": "second"}

    custom = client.CustomObjectsApi(k8s)
    obj = custom.create_namespaced_custom_object(*CR, tiered_model())
    del obj["metadata"]["resourceVersion"]  # custom resources refuse unconditional updates
    code, status = api_error(custom.replace_namespaced_custom_object, *CR, "m", obj)
    assert (code, status["details"]["causes"][0]["field"]) == (422, "metadata.resourceVersion")

    leases = client.CoordinationV1Api(k8s)
    lease = leases.create_namespaced_lease(NS, client.V1Lease(
        metadata=client.V1ObjectMeta(name="leader"),
        spec=client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15)))
    lease.spec.holder_identity = "b"
    renewed = leases.replace_namespaced_lease("leader", NS, lease)
    assert renewed.spec.holder_identity == "b"
    lease.spec.holder_identity = "c"  # still carries the old resourceVersion
    code, _ = api_error(leases.replace_namespaced_lease, "leader", NS, lease)
    assert code == 409
    assert leases.read_namespaced_lease("leader", NS).spec.holder_identity == "b"


def test_status_subresource_is_isolated_both_ways(api, k8s):
    custom = client.CustomObjectsApi(k8s)
    created = custom.create_namespaced_custom_object(
        *CR, {**tiered_model(), "status": {"stage": "ignored on create"}})
    assert "status" not in created
    obj = custom.replace_namespaced_custom_object_status(
        *CR, "m", {**created, "status": {"stage": "canary"},
                   "spec": {**created["spec"], "artifact": {"uri": "ignored.onnx"}}})
    assert (obj["status"]["stage"], obj["spec"]["artifact"]["uri"]) == ("canary", "model.onnx")
    assert obj["metadata"]["generation"] == 1
    obj["status"] = {"stage": "ignored on the main resource"}
    obj["spec"]["artifact"]["uri"] = "v2.onnx"
    obj = custom.replace_namespaced_custom_object(*CR, "m", obj)
    assert (obj["status"]["stage"], obj["spec"]["artifact"]["uri"]) == ("canary", "v2.onnx")
    obj = custom.patch_namespaced_custom_object(*CR, "m", {"status": {"stage": "nope"}})
    assert obj["status"]["stage"] == "canary"
    obj = custom.patch_namespaced_custom_object_status(
        *CR, "m", {"spec": {"artifact": {"uri": "nope.onnx"}}, "status": {"stage": "stable"}})
    assert (obj["status"]["stage"], obj["spec"]["artifact"]["uri"]) == ("stable", "v2.onnx")
    assert api.objects(PLURAL)[0]["status"]["stage"] == "stable"


def test_merge_json_and_strategic_patches_and_their_content_types(api, k8s):
    custom = client.CustomObjectsApi(k8s)
    custom.create_namespaced_custom_object(*CR, tiered_model(labels={"a": "1", "b": "2"}))
    obj = custom.patch_namespaced_custom_object(
        *CR, "m", {"metadata": {"labels": {"a": None, "c": "3"}}})
    assert obj["metadata"]["labels"] == {"b": "2", "c": "3"}
    obj = custom.patch_namespaced_custom_object(
        *CR, "m", [{"op": "test", "path": "/spec/artifact/uri", "value": "model.onnx"},
                   {"op": "replace", "path": "/spec/artifact/uri", "value": "v2.onnx"},
                   {"op": "remove", "path": "/metadata/labels/b"}],
        _content_type="application/json-patch+json")
    assert (obj["spec"]["artifact"]["uri"], obj["metadata"]["labels"]) == ("v2.onnx", {"c": "3"})
    code, status = api_error(
        custom.patch_namespaced_custom_object, *CR, "m",
        [{"op": "test", "path": "/spec/artifact/uri", "value": "model.onnx"}],
        _content_type="application/json-patch+json")
    assert (code, status["reason"]) == (422, "Invalid")
    stale = {"metadata": {"resourceVersion": "1001"}, "spec": {"artifact": {"uri": "x.onnx"}}}
    code, _ = api_error(custom.patch_namespaced_custom_object, *CR, "m", stale)
    assert code == 409
    code, _ = api_error(custom.patch_namespaced_custom_object, *CR, "m", {"spec": {}},
                        _content_type="application/strategic-merge-patch+json")
    assert code == 415  # as the real server: no strategic merge for custom resources

    apps = client.AppsV1Api(k8s)
    apps.create_namespaced_deployment(NS, deployment("d"))
    d = apps.patch_namespaced_deployment("d", NS, {"spec": {"template": {"spec": {"containers": [
        {"name": "agent", "env": [{"name": "B", "value": "2"}]},
        {"name": "sidecar", "image": "side:1"}]}}}})
    containers = d.spec.template.spec.containers
    assert [(c.name, c.image) for c in containers] == [("agent", "agent:1"), ("sidecar", "side:1")]
    assert [(e.name, e.value) for e in containers[0].env] == [("A", "1"), ("B", "2")]
    d = apps.patch_namespaced_deployment(
        "d", NS, [{"op": "replace", "path": "/spec/replicas", "value": 4}])
    assert d.spec.replicas == 4

    kinds = [(r.method, r.path.rsplit("/", 1)[-1], r.content_type)
             for r in api.requests if r.method == "PATCH"]
    assert kinds == [
        ("PATCH", "m", "application/merge-patch+json"),
        ("PATCH", "m", "application/json-patch+json"),
        ("PATCH", "m", "application/json-patch+json"),
        ("PATCH", "m", "application/merge-patch+json"),
        ("PATCH", "m", "application/strategic-merge-patch+json"),
        ("PATCH", "d", "application/strategic-merge-patch+json"),  # dict body, built-in kind
        ("PATCH", "d", "application/json-patch+json"),  # list body
    ]


def test_finalizers_hold_deletion_until_emptied(api, k8s):
    custom = client.CustomObjectsApi(k8s)
    custom.create_namespaced_custom_object(*CR, tiered_model(finalizers=["tiered.dev/cleanup"]))
    deleting = custom.delete_namespaced_custom_object(*CR, "m")
    assert deleting["metadata"]["deletionTimestamp"]
    assert deleting["metadata"]["deletionGracePeriodSeconds"] == 0
    assert deleting["metadata"]["generation"] == 2  # the real server bumps it here too
    still = custom.get_namespaced_custom_object(*CR, "m")
    assert still["metadata"]["deletionTimestamp"] == deleting["metadata"]["deletionTimestamp"]
    code, _ = api_error(custom.patch_namespaced_custom_object, *CR, "m",
                        {"metadata": {"finalizers": ["tiered.dev/cleanup", "new"]}})
    assert code == 422
    custom.patch_namespaced_custom_object(*CR, "m", {"metadata": {"finalizers": None}})
    code, _ = api_error(custom.get_namespaced_custom_object, *CR, "m")
    assert code == 404
    assert [(w.verb, w.resource_version) for w in api.events] == [
        ("POST", "1001"), ("DELETE", "1002"), ("PATCH", "1003")]
    events = [(e["type"], e["object"]["metadata"]["resourceVersion"])
              for e in take(2, custom.list_namespaced_custom_object, *CR, resource_version="1001")]
    assert events == [("MODIFIED", "1002"), ("DELETED", "1003")]


def test_owner_references_are_garbage_collected(api, k8s):
    custom, apps, core = client.CustomObjectsApi(k8s), client.AppsV1Api(k8s), client.CoreV1Api(k8s)
    owner = custom.create_namespaced_custom_object(*CR, tiered_model())
    other = custom.create_namespaced_custom_object(*CR, tiered_model("other"))
    apps.create_namespaced_deployment(NS, deployment("edge", owner))
    apps.create_namespaced_deployment(NS, deployment("unrelated", other))
    ref = deployment("x", owner).metadata.owner_references
    core.create_namespaced_config_map(NS, config_map("cfg", owner_references=ref))
    core.create_namespaced_config_map(NS, config_map("held", owner_references=ref,
                                                     finalizers=["keep"]))
    gone = custom.delete_namespaced_custom_object(*CR, "m")
    assert gone["metadata"]["name"] == "m"
    assert [d["metadata"]["name"] for d in api.objects("deployments")] == ["unrelated"]
    assert [c["metadata"]["name"] for c in api.objects("configmaps")] == ["held"]
    assert api.objects("configmaps")[0]["metadata"]["deletionTimestamp"]
    assert [(w.verb, w.path.rsplit("/", 2)[-2:]) for w in api.events[-4:]] == [
        ("DELETE", ["tieredmodels", "m"]), ("gc", ["deployments", "edge"]),
        ("gc", ["configmaps", "cfg"]), ("gc", ["configmaps", "held"])]
    # Already deleting: answered with the object, unchanged. (kubernetes>=35 returns
    # delete responses as plain dicts: the return type is `object`.)
    again = core.delete_namespaced_config_map("held", NS)
    assert again["metadata"]["finalizers"] == ["keep"]
    assert again["metadata"]["resourceVersion"] == api.events[-1].resource_version
    core.delete_namespaced_config_map("held", NS)
    done = core.patch_namespaced_config_map("held", NS, {"metadata": {"finalizers": None}})
    assert api.objects("configmaps") == []
    assert done.metadata.finalizers == ["keep"]  # the DELETED object is the last stored state
    status = client.AppsV1Api(k8s).delete_namespaced_deployment("unrelated", NS)
    assert (status["kind"], status["status"], status["details"]["name"]) == (
        "Status", "Success", "unrelated")


def test_watch_from_resource_version_gets_exactly_the_later_events(api, k8s):
    core = client.CoreV1Api(k8s)
    core.create_namespaced_config_map(NS, config_map("a"))
    since = core.list_namespaced_config_map(NS).metadata.resource_version
    core.create_namespaced_config_map(NS, config_map("b"))
    core.patch_namespaced_config_map("a", NS, {"data": {"k": "v2"}})
    core.delete_namespaced_config_map("b", NS)
    core.create_namespaced_config_map("other", config_map("c"))
    w = watch.Watch()
    events = [(e["type"], e["object"].metadata.name, e["object"].metadata.resource_version)
              for e in w.stream(core.list_namespaced_config_map, NS,
                                resource_version=since, timeout_seconds=1)]
    assert events == [("ADDED", "b", "1002"), ("MODIFIED", "a", "1003"),
                      ("DELETED", "b", "1004")]
    initial = [(e["type"], e["object"].metadata.name)
               for e in take(2, core.list_config_map_for_all_namespaces)]
    assert initial == [("ADDED", "a"), ("ADDED", "c")]


def test_watch_streams_live_events_and_bookmarks(api, k8s):
    api.bookmark_interval = 0.2
    custom = client.CustomObjectsApi(k8s)
    seen = []

    def consume():
        w = watch.Watch()
        for e in w.stream(custom.list_namespaced_custom_object, *CR, resource_version="1000",
                          allow_watch_bookmarks=True, timeout_seconds=2):
            seen.append((e["type"], e["raw_object"]["metadata"]["resourceVersion"]))
            if e["type"] == "DELETED":
                w.stop()

    reader = threading.Thread(target=consume)
    reader.start()
    assert api.wait_for_watches(1)
    time.sleep(0.3)  # long enough for a bookmark
    custom.create_namespaced_custom_object(*CR, tiered_model())
    custom.delete_namespaced_custom_object(*CR, "m")
    reader.join(5)
    assert not reader.is_alive()
    assert ("BOOKMARK", "1000") in seen
    assert [s for s in seen if s[0] != "BOOKMARK"] == [("ADDED", "1001"), ("DELETED", "1002")]
    deadline = time.monotonic() + 2  # the client hung up: the server lets the stream go
    while api.watching and time.monotonic() < deadline:
        time.sleep(0.05)
    assert api.watching == 0


def test_watch_with_label_selector_sees_objects_enter_and_leave(api, k8s):
    core = client.CoreV1Api(k8s)
    core.create_namespaced_config_map(NS, config_map("a", labels={"tier": "edge"}))
    since = core.list_namespaced_config_map(NS).metadata.resource_version
    core.create_namespaced_config_map(NS, config_map("b", labels={"tier": "dc"}))
    core.patch_namespaced_config_map("a", NS, {"metadata": {"labels": {"tier": "dc"}}})
    core.patch_namespaced_config_map("b", NS, {"metadata": {"labels": {"tier": "edge"}}})
    events = [(e["type"], e["object"].metadata.name) for e in take(
        2, core.list_namespaced_config_map, NS, label_selector="tier=edge",
        resource_version=since)]
    assert events == [("DELETED", "a"), ("ADDED", "b")]


def test_watch_after_compaction_is_410_gone(api, k8s):
    core = client.CoreV1Api(k8s)
    core.create_namespaced_config_map(NS, config_map("a"))
    core.create_namespaced_config_map(NS, config_map("b"))
    api.compact()
    w = watch.Watch()
    with pytest.raises(client.ApiException) as info:
        list(w.stream(core.list_namespaced_config_map, NS, resource_version="1001",
                      timeout_seconds=5))
    assert info.value.status == 410
    assert info.value.reason == "Expired: too old resource version: 1001 (1002)"
    assert sum(r.query.get("watch") == "true" for r in api.requests) == 1
    # Without timeout_seconds the client retries once from the same version, then raises.
    with pytest.raises(client.ApiException) as info:
        list(w.stream(core.list_namespaced_config_map, NS, resource_version="1001"))
    assert info.value.status == 410
    assert sum(r.query.get("watch") == "true" for r in api.requests) == 3
    # A watch from the compacted-to version still works and sees only later writes.
    core.create_namespaced_config_map(NS, config_map("c"))
    assert [e["object"].metadata.name for e in take(
        1, core.list_namespaced_config_map, NS, resource_version="1002")] == ["c"]


def test_history_window_expires_old_versions():
    with FakeKubeAPI(history=3) as small, client.ApiClient(small.client_configuration()) as k:
        core = client.CoreV1Api(k)
        for name in "abcde":
            core.create_namespaced_config_map(NS, config_map(name))
        names = [e["object"].metadata.name for e in take(
            3, core.list_namespaced_config_map, NS, resource_version="1002")]
        assert names == ["c", "d", "e"]
        w = watch.Watch()
        with pytest.raises(client.ApiException) as info:
            list(w.stream(core.list_namespaced_config_map, NS, resource_version="1001",
                          timeout_seconds=1))
        assert info.value.status == 410


def test_drop_watches_ends_streams_and_the_client_resumes(api, k8s):
    core = client.CoreV1Api(k8s)
    core.create_namespaced_config_map(NS, config_map("a"))
    ended, seen = threading.Event(), []

    def bounded():  # with timeout_seconds the client does not reconnect
        list(watch.Watch().stream(core.list_namespaced_config_map, NS, timeout_seconds=60))
        ended.set()

    def resuming():  # without it, the client reconnects from the last resourceVersion
        w = watch.Watch()
        for e in w.stream(core.list_namespaced_config_map, NS):
            seen.append((e["type"], e["object"].metadata.name))
            if e["object"].metadata.name == "after":
                w.stop()

    threads = [threading.Thread(target=bounded), threading.Thread(target=resuming)]
    for t in threads:
        t.start()
    assert api.wait_for_watches(2)
    time.sleep(0.2)  # both streams have sent their initial ADDED event
    started = time.monotonic()
    api.drop_watches()
    assert ended.wait(5) and time.monotonic() - started < 2
    core.create_namespaced_config_map(NS, config_map("after"))
    threads[1].join(5)
    assert not threads[1].is_alive()
    assert seen == [("ADDED", "a"), ("ADDED", "after")]
    resumed = [r.query for r in api.requests if r.query.get("watch") == "true"][-1]
    assert resumed["resourceVersion"] == "1001"


def test_fail_next_injects_one_error(api, k8s):
    core = client.CoreV1Api(k8s)
    api.fail_next("POST", r"/configmaps$", 500)
    code, status = api_error(core.create_namespaced_config_map, NS, config_map("a"))
    assert (code, status["reason"]) == (500, "InternalError")
    assert core.create_namespaced_config_map(NS, config_map("a")).metadata.name == "a"
    api.fail_next("PUT", r"/configmaps/a$", 409)
    code, _ = api_error(core.replace_namespaced_config_map, "a", NS, config_map("a"))
    assert code == 409
    assert [w.verb for w in api.events] == ["POST"]


def test_crd_schema_is_validated_defaulted_and_pruned(api, k8s):
    custom = client.CustomObjectsApi(k8s)
    body = tiered_model()
    del body["spec"]["artifact"]
    body["spec"]["tiers"]["edge"]["replicas"] = -1
    code, status = api_error(custom.create_namespaced_custom_object, *CR, body)
    assert (code, status["reason"], status["details"]["kind"]) == (422, "Invalid", "TieredModel")
    assert sorted(c["field"] for c in status["details"]["causes"]) == [
        "spec.artifact", "spec.tiers.edge.replicas"]
    assert status["message"].startswith('TieredModel.tiered.dev "m" is invalid: [')

    body = tiered_model()
    body["spec"]["unknown"] = {"dropped": True}
    obj = custom.create_namespaced_custom_object(*CR, body)
    assert "unknown" not in obj["spec"]
    assert set(obj["spec"]["tiers"]["edge"]) > {"replicas"}  # the CRD's defaults filled in
    code, status = api_error(custom.patch_namespaced_custom_object_status, *CR, "m",
                             {"status": {"rollout": {"phase": "Sideways"}}})
    assert code == 422
    assert "status.rollout.phase" in {c["field"] for c in status["details"]["causes"]}


# ---- kubectl's needs, on a CRD of the tests' own (spellings independent of tiered's spec)

def widget_schema(spec: dict) -> dict:
    return {"openAPIV3Schema": {"type": "object", "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {"type": "object", "properties": spec},
        "status": {"type": "object", "properties": {
            "phase": {"type": "string"}, "ratio": {"type": "number"},
            "conditions": {"type": "array", "items": {
                "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}}}


WIDGETS = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.dev"},
    "spec": {"group": "example.dev", "scope": "Namespaced",
             "names": {"plural": "widgets", "singular": "widget", "kind": "Widget",
                       "shortNames": ["wd"], "categories": ["toys"]},
             "versions": [
                 {"name": "v1beta1", "served": True, "storage": False, "deprecated": True,
                  "schema": widget_schema({"size": {"type": "integer"},
                                           "legacy": {"type": "string", "default": "x"}}),
                  "subresources": {"status": {}}},
                 {"name": "v1", "served": True, "storage": True,
                  "schema": widget_schema({
                      "size": {"type": "integer", "minimum": 1},
                      "colour": {"type": "string", "enum": ["red", "blue"],
                                 "default": "red"}}),
                  "subresources": {"status": {}},
                  "additionalPrinterColumns": [
                      {"name": "Ready", "type": "string",
                       "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                      {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                      {"name": "Ratio", "type": "number", "jsonPath": ".status.ratio",
                       "priority": 1, "description": "how much"},
                      {"name": "Age", "type": "date",
                       "jsonPath": ".metadata.creationTimestamp"}]},
                 {"name": "v1alpha1", "served": False, "storage": False,
                  "schema": widget_schema({})}]}}
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
AGGREGATED = ("application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,"
              "application/json")


@pytest.fixture
def widgets(tmp_path):
    path = tmp_path / "widgets.yaml"
    path.write_text(yaml.safe_dump(WIDGETS))
    with FakeKubeAPI(crd=path) as server:
        yield server


def http(api, method: str, path: str, body=None, accept: str = "application/json",
         ctype: str = "application/json") -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one plain HTTP request; headers by lower-case
    name, repeated ones joined by newlines."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(api.url + path, data=data, method=method, headers={
        "Accept": accept, "Content-Type": ctype})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            code, headers, raw = response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        code, headers, raw = e.code, e.headers, e.read()
    merged = {k.lower(): "\n".join(headers.get_all(k)) for k in set(headers.keys())}
    return code, merged, json.loads(raw)


def widget(name="w", size=3, **spec):
    return {"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": name},
            "spec": {"size": size, **spec}}


W = "/apis/example.dev/v1/namespaces/default/widgets"
W1B1 = "/apis/example.dev/v1beta1/namespaces/default/widgets"


def test_discovery_legacy_and_aggregated(widgets):
    code, headers, versions = http(widgets, "GET", "/api")
    assert (code, versions["kind"], versions["versions"]) == (200, "APIVersions", ["v1"])
    _, _, groups = http(widgets, "GET", "/apis")
    listed = {g["name"]: g for g in groups["groups"]}
    assert listed["example.dev"]["preferredVersion"]["version"] == "v1"
    assert [v["version"] for v in listed["example.dev"]["versions"]] == ["v1", "v1beta1"]
    assert {"apps", "coordination.k8s.io", "discovery.k8s.io"} <= set(listed)
    _, _, group = http(widgets, "GET", "/apis/example.dev")
    assert (group["kind"], group["name"]) == ("APIGroup", "example.dev")
    _, _, resources = http(widgets, "GET", "/apis/example.dev/v1")
    assert resources["groupVersion"] == "example.dev/v1"
    by_name = {r["name"]: r for r in resources["resources"]}
    assert by_name["widgets"] == {
        "name": "widgets", "singularName": "widget", "namespaced": True, "kind": "Widget",
        "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update",
                  "watch"], "shortNames": ["wd"], "categories": ["toys"]}
    assert by_name["widgets/status"]["verbs"] == ["get", "patch", "update"]
    _, _, core = http(widgets, "GET", "/api/v1")
    assert {r["name"]: r.get("shortNames") for r in core["resources"]}["services"] == ["svc"]
    assert http(widgets, "GET", "/apis/example.dev/v1alpha1")[0] == 404  # not served

    code, headers, aggregated = http(widgets, "GET", "/apis", accept=AGGREGATED)
    assert headers["content-type"] == (
        "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList")
    assert aggregated["kind"] == "APIGroupDiscoveryList"
    entry = next(i for i in aggregated["items"] if i["metadata"].get("name") == "example.dev")
    assert [v["version"] for v in entry["versions"]] == ["v1", "v1beta1"]
    resource = entry["versions"][0]["resources"][0]
    assert (resource["resource"], resource["scope"], resource["shortNames"],
            resource["responseKind"]) == ("widgets", "Namespaced", ["wd"], {
                "group": "example.dev", "version": "v1", "kind": "Widget"})
    assert resource["subresources"][0]["subresource"] == "status"
    _, _, core = http(widgets, "GET", "/api", accept=AGGREGATED)
    assert [i["metadata"] for i in core["items"]] == [{}]
    assert "pods" in {r["resource"] for r in core["items"][0]["versions"][0]["resources"]}


def test_openapi_v3_names_field_validation_for_each_served_version(widgets):
    _, _, index = http(widgets, "GET", "/openapi/v3")
    assert set(index["paths"]) == {"apis/example.dev/v1", "apis/example.dev/v1beta1"}
    url = index["paths"]["apis/example.dev/v1"]["serverRelativeURL"]
    assert url.startswith("/openapi/v3/apis/example.dev/v1?hash=")
    _, _, doc = http(widgets, "GET", url)
    patch = doc["paths"]["/apis/example.dev/v1/namespaces/{namespace}/widgets/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"] == {
        "group": "example.dev", "version": "v1", "kind": "Widget"}
    assert "fieldValidation" in {p["name"] for p in patch["parameters"] if p["in"] == "query"}
    assert "application/strategic-merge-patch+json" not in patch["requestBody"]["content"]
    schema = doc["components"]["schemas"]["dev.example.v1.Widget"]
    assert schema["properties"]["spec"]["properties"]["colour"]["enum"] == ["red", "blue"]
    assert http(widgets, "GET", "/openapi/v3/apis/apps/v1")[0] == 404


def test_crd_schema_of_the_request_version_validates_prunes_and_defaults(widgets):
    code, _, status = http(widgets, "POST", W, widget(size=0, colour="green"))
    assert (code, status["reason"]) == (422, "Invalid")
    assert sorted(c["field"] for c in status["details"]["causes"]) == ["spec.colour",
                                                                       "spec.size"]
    code, _, obj = http(widgets, "POST", W, widget(size=3.0, extra=1))  # 3.0 is an integer
    assert code == 201 and obj["spec"] == {"size": 3, "colour": "red"}


def test_field_validation_strict_warn_and_ignore(widgets):
    code, headers, status = http(widgets, "POST", W + "?fieldValidation=Strict",
                                 widget(extra=1, more={"a": 1}))
    assert (code, status["reason"]) == (400, "BadRequest")
    assert status["message"] == (
        'Widget in version "v1" cannot be handled as a Widget: strict decoding error: '
        'unknown field "spec.extra", unknown field "spec.more"')
    assert not widgets.objects("widgets")
    code, headers, obj = http(widgets, "POST", W, widget(extra=1))  # Warn by default
    assert code == 201 and "extra" not in obj["spec"]
    assert headers["warning"] == '299 - "unknown field \\"spec.extra\\""'
    code, headers, _ = http(widgets, "PATCH", W + "/w?fieldValidation=Ignore",
                            {"spec": {"other": 2}}, ctype="application/merge-patch+json")
    assert code == 200 and "warning" not in headers
    code, _, status = http(widgets, "PATCH", W + "/w?fieldValidation=Strict",
                           {"spec": {"other": 2}}, ctype="application/merge-patch+json")
    assert code == 400 and 'unknown field "spec.other"' in status["message"]


def test_served_versions_share_one_store_converted_on_the_way(widgets):
    # written at the deprecated version: a Warning; stored at v1, pruned by v1's schema
    code, headers, obj = http(widgets, "POST", W1B1, {
        "apiVersion": "example.dev/v1beta1", "kind": "Widget", "metadata": {"name": "w"},
        "spec": {"size": 2, "legacy": "kept?"}})
    assert code == 201
    assert headers["warning"] == '299 - "example.dev/v1beta1 Widget is deprecated"'
    [stored] = widgets.objects("widgets")
    assert stored["apiVersion"] == "example.dev/v1"
    assert stored["spec"] == {"size": 2, "colour": "red"}
    # read at v1beta1: pruned and defaulted by v1beta1's schema
    assert obj["apiVersion"] == "example.dev/v1beta1"
    assert obj["spec"] == {"size": 2, "legacy": "x"}
    _, _, listed = http(widgets, "GET", W1B1)
    assert listed["apiVersion"] == "example.dev/v1beta1"
    assert [i["apiVersion"] for i in listed["items"]] == ["example.dev/v1beta1"]
    code, _, status = http(widgets, "POST", W1B1, widget("v"))  # apiVersion not the URL's
    assert code == 400
    assert http(widgets, "GET", "/apis/example.dev/v1alpha1/namespaces/default/widgets")[0] \
        == 404
    # a CRD update moving storage to v1beta1: later writes are stored there
    widgets.set_storage_version("v1beta1")
    http(widgets, "PATCH", W1B1 + "/w", {"spec": {"legacy": "now kept"}},
         ctype="application/merge-patch+json")
    [stored] = widgets.objects("widgets")
    assert stored["apiVersion"] == "example.dev/v1beta1"
    assert stored["spec"] == {"size": 2, "legacy": "now kept"}
    assert http(widgets, "GET", W + "/w")[2]["spec"] == {"size": 2, "colour": "red"}


def test_tables_from_the_printer_columns(widgets):
    http(widgets, "POST", W, widget("a", 3))
    http(widgets, "POST", W, widget("b", 5))
    http(widgets, "PATCH", W + "/a/status", {"status": {"ratio": 0.5, "conditions": [
        {"type": "Other", "status": "False"}, {"type": "Ready", "status": "True"}]}},
        ctype="application/merge-patch+json")
    code, headers, table = http(widgets, "GET", W, accept=TABLE)
    assert headers["content-type"] == "application/json;as=Table;v=v1;g=meta.k8s.io"
    assert (table["kind"], table["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert [(c["name"], c["type"], c["priority"]) for c in table["columnDefinitions"]] == [
        ("Name", "string", 0), ("Ready", "string", 0), ("Size", "integer", 0),
        ("Ratio", "number", 1), ("Age", "date", 0)]
    assert table["columnDefinitions"][3]["description"] == "how much"
    assert [r["cells"][:4] for r in table["rows"]] == [["a", "True", 3, 0.5],
                                                       ["b", None, 5, None]]
    assert table["rows"][0]["cells"][4] in ("0s", "1s", "2s")
    assert table["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert table["rows"][0]["object"]["metadata"]["name"] == "a"
    _, _, table = http(widgets, "GET", W + "?includeObject=None", accept=TABLE)
    assert "object" not in table["rows"][0]
    _, _, table = http(widgets, "GET", W + "/b?includeObject=Object", accept=TABLE)
    assert [r["object"]["spec"]["size"] for r in table["rows"]] == [5]
    # a version without columns: Name and Age; built-in kinds answer plain JSON
    _, _, table = http(widgets, "GET", W1B1, accept=TABLE)
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Age"]
    code, headers, listed = http(widgets, "GET", "/api/v1/namespaces/default/pods",
                                 accept=TABLE)
    assert listed["kind"] == "PodList" and headers["content-type"] == "application/json"
    # kubectl get -w: every event a Table of its row
    request = urllib.request.Request(widgets.url + W + "?watch=true&timeoutSeconds=1",
                                     headers={"Accept": TABLE})
    with urllib.request.urlopen(request, timeout=10) as stream:
        events = [json.loads(line) for line in stream.read().splitlines() if line]
    assert [(e["type"], e["object"]["kind"], e["object"]["rows"][0]["cells"][0])
            for e in events] == [("ADDED", "Table", "a"), ("ADDED", "Table", "b")]


def test_jsonpath_and_what_kubectl_prints():
    obj = {"status": {"conditions": [{"type": "A", "status": "x", "n": 1},
                                     {"type": "Ready", "status": "True", "n": 2}]},
           "metadata": {"labels": {"a.b/c": "d"}}}
    assert jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert jsonpath(obj, ".status.conditions[?(@.type!='Ready')].status") == ["x"]
    assert jsonpath(obj, ".status.conditions[?(@.n > 1)].type") == ["Ready"]
    assert jsonpath(obj, ".status.conditions[*].type") == ["A", "Ready"]
    assert jsonpath(obj, ".status.conditions[-1].n") == [2]
    assert jsonpath(obj, "{.metadata.labels['a.b/c']}") == ["d"]
    assert jsonpath(obj, ".status.missing.deeper") == []
    with pytest.raises(ValueError):
        jsonpath(obj, ".status..type")
    assert [go_text(v) for v in (1e6, 0.5, 5.0, 1234567.0, 1e-5, True, None,
                                 {"b": 1, "a": [1, "x"]})] == [
        "1e+06", "0.5", "5", "1.234567e+06", "1e-05", "true", "<nil>", "map[a:[1 x] b:1]"]
    assert [human_duration(s) for s in (5, 119, 130, 600, 7260, 40000, 200000, 800000,
                                        -5)] == [
        "5s", "119s", "2m10s", "10m", "121m", "11h", "2d7h", "9d", "<invalid>"]


def test_events_select_on_their_involved_object(api, k8s):
    core = client.CoreV1Api(k8s)
    for name, about, uid, reason in (("e1", "m", "u1", "Started"), ("e2", "m", "u2", "Old"),
                                     ("e3", "n", "u3", "Started"),
                                     ("e4", "a,b=c", "u4", "Odd")):
        core.create_namespaced_event(NS, {
            "metadata": {"name": name}, "reason": reason, "type": "Normal",
            "source": {"component": "ctl"} if name != "e2" else {},
            "reportingComponent": "rc",
            "involvedObject": {"kind": "TieredModel", "name": about, "namespace": NS,
                               "uid": uid}})

    def names(selector: str) -> list[str]:
        return [e.metadata.name for e in core.list_namespaced_event(
            NS, field_selector=selector).items]

    assert names("involvedObject.name=m,involvedObject.namespace=default,"
                 "involvedObject.kind=TieredModel,involvedObject.uid=u1") == ["e1"]
    assert names("involvedObject.name=m") == ["e1", "e2"]
    assert names("reason!=Started") == ["e2", "e4"]
    assert names("source=rc") == ["e2"]  # no source component: the reporting one
    assert names(r"involvedObject.name=a\,b\=c") == ["e4"]
    assert names("involvedObject.fieldPath=") == ["e1", "e2", "e3", "e4"]
    code, status = api_error(core.list_namespaced_config_map, NS,
                             field_selector="involvedObject.name=m")
    assert (code, status["message"]) == (400, "field label not supported: involvedObject.name")
    events = take(1, core.list_namespaced_event, NS, field_selector="involvedObject.uid=u3")
    assert [e["object"].metadata.name for e in events] == ["e3"]
