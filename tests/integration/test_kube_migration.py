"""A TieredModel stored at v1alpha1 (before the CRD moved its storage to
v1alpha2) is rewritten at v1alpha2 by the controller's first read, spec and
status; one stored at v1alpha2 is left alone. Against the API double, whose
CRD versions convert as the real API server's do with strategy None: the
renamed fields are pruned from the other version's view."""

from __future__ import annotations

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client  # noqa: E402

from tests.kubeapi import FakeKubeAPI  # noqa: E402
from tiered.controller.kube import render  # noqa: E402
from tiered.controller.kube.backend import KubeBackend  # noqa: E402
from tiered.controller.reconciler import decode_status  # noqa: E402
from tiered.rollout.spec import load_tiered_model  # noqa: E402
from tiered.rollout.status import HistoryEntry, RolloutStatus, TieredModelStatus  # noqa: E402
from tiered.rollout.wire import API_GROUP, to_plain  # noqa: E402

NAMESPACE = "ml"
SPEC = {"artifact": {"uri": "https://models.example/digits.onnx", "sha256": "ab" * 32},
        "tiers": {"edge": {"batching": {"max_batch_size": 4, "max_queue_delay_us": 300}}},
        "routing": {"slo_ms": 20},
        "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10},
                                "min_duration_s": 5, "max_duration_s": 50}],
                    "analysis": {"interval_s": 3}}}
STATUS = TieredModelStatus(
    rollout=RolloutStatus(stable_version=1, canary_version=2, stage_started_at=1796148819.5,
                          message="judging"),
    stage="1/1 edge", weights={"edge": 10.0}, weights_summary="edge 10%",
    observed_generation=1,
    history=(HistoryEntry(t=1796148819.5, action="start", reason="v2 applied",
                          phase="Progressing", stable_version=1, canary_version=2),))


def old_object(name: str) -> dict:
    return {"apiVersion": f"{API_GROUP}/v1alpha1", "kind": "TieredModel",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": SPEC}


def test_an_object_stored_at_v1alpha1_is_rewritten_at_v1alpha2_before_it_is_reconciled():
    with FakeKubeAPI() as api:
        kube = client.ApiClient(api.client_configuration())
        custom = client.CustomObjectsApi(kube)
        api.set_storage_version("v1alpha1")  # the cluster before the upgrade
        for name in ("old", "untouched"):
            made = custom.create_namespaced_custom_object(API_GROUP, "v1alpha1", NAMESPACE,
                                                          "tieredmodels", old_object(name))
            made["status"] = to_plain(STATUS, spell=None)
            custom.replace_namespaced_custom_object_status(API_GROUP, "v1alpha1", NAMESPACE,
                                                           "tieredmodels", name, made)
        api.set_storage_version("v1alpha2")  # the new CRD
        # Read at v1alpha2 before migrating: the renamed fields are gone.
        pruned = custom.get_namespaced_custom_object(API_GROUP, "v1alpha2", NAMESPACE,
                                                     "tieredmodels", "old")
        assert "stableVersion" not in pruned["status"]["rollout"]
        assert pruned["spec"]["routing"]["sloMilliseconds"] == 50  # the default, not 20

        lines: list[str] = []
        backend = KubeBackend(render.ClusterSettings(namespace=NAMESPACE), kube, {},
                              lines.append)
        writes = len(api.events)
        found = backend.read("old")  # a read writes nothing; it says what is to be written
        assert len(api.events) == writes and lines == []
        assert not found.settled and found.rewrite.from_version == "v1alpha1"
        stored = backend.settle(found)  # what the Reconciler does with it
        assert stored.settled
        assert lines == [f"old: rewritten from {API_GROUP}/v1alpha1 as v1alpha2"]
        assert load_tiered_model(stored.document) == load_tiered_model(
            {"name": "old", **SPEC})
        assert decode_status("old", stored.status) == STATUS
        (kept,) = [o for o in api.objects("tieredmodels") if o["metadata"]["name"] == "old"]
        assert kept["apiVersion"] == f"{API_GROUP}/v1alpha2"
        assert kept["spec"]["routing"] == {"sloMilliseconds": 20, "policy": "slo-energy",
                                           "cascade": kept["spec"]["routing"]["cascade"]}
        assert kept["status"]["rollout"]["stageStartedAt"] == "2026-12-01T18:13:39.500000Z"

        # Read again: at v1alpha2 now, settled, nothing more is written.
        writes = len(api.events)
        again = backend.read("old")
        assert again.settled and decode_status("old", again.status) == STATUS
        assert len(api.events) == writes and len(lines) == 1
        (other,) = [o for o in api.objects("tieredmodels")
                    if o["metadata"]["name"] == "untouched"]
        assert other["apiVersion"] == f"{API_GROUP}/v1alpha1"  # not read yet: as it was
