"""Kubernetes objects from a spec, and reading the kubelet's pod status back."""

from __future__ import annotations

import pytest

from tiered.controller.desired import ArtifactVersion
from tiered.controller.kube import render
from tiered.protocol.verdict import BuildVerdict
from tiered.rollout.spec import load_tiered_model

SHA = "a" * 64
REFUSED = ("artifact: /models/in/digits.onnx has sha256 " + "b" * 64 +
           ", not the expected " + SHA + "; refusing to build it")
VERDICT = BuildVerdict(built=False, model="digits", version=3, tier="edge", reason=REFUSED,
                       installed=None, exit_code=2).to_json()


def spec():
    return load_tiered_model({
        "name": "digits", "artifact": {"uri": "https://models.example/digits.onnx", "sha256": SHA},
        "tiers": {"edge": {}}, "rollout": {"stages": [{"name": "all", "weights": {"edge": 100}}]}})


def workload():
    return render.agent_workload(spec(), "edge", ArtifactVersion(3, spec().artifact.uri, SHA),
                                 render.Owner("digits", "uid-1"), render.ClusterSettings("models"))


def test_the_build_reports_its_failure_through_its_logs():
    (build,) = workload()["spec"]["template"]["spec"]["initContainers"]
    assert build["name"] == render.BUILD_CONTAINER
    assert build["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert build["terminationMessagePath"] == render.TERMINATION_LOG
    assert build["command"][-2:] == ["--termination-log", render.TERMINATION_LOG]


def test_the_pod_selector_selects_the_workload_pods():
    labels = workload()["spec"]["template"]["metadata"]["labels"]
    selector = dict(pair.split("=") for pair in render.pod_selector("digits", "edge", 3).split(","))
    assert selector == labels


def pod(*init_statuses):
    return {"status": {"initContainerStatuses": list(init_statuses)}}


def build_status(state=None, last_state=None, name=render.BUILD_CONTAINER):
    return {"name": name, "ready": False, "restartCount": 1, "image": "tiered-agent",
            "imageID": "", "state": state or {}, "lastState": last_state or {}}


def terminated(code, message=None, reason="Error"):
    return {"terminated": {"exitCode": code, "reason": reason,
                           **({"message": message} if message is not None else {})}}


@pytest.mark.parametrize(("pods", "failure"), [
    ([], None),                                                         # no pod scheduled yet
    ([{"status": {}}], None),                                           # pending, no statuses
    ([pod(build_status({"running": {}}))], None),                       # still building
    ([pod(build_status(terminated(0, "", "Completed")))], None),        # built
    ([pod(build_status(terminated(2, VERDICT)))], REFUSED),            # the verdict file
    ([pod(build_status(terminated(2, f"fetching\n{VERDICT}\n")))], REFUSED),  # logs' last
    ([pod(build_status({"waiting": {"reason": "CrashLoopBackOff"}},     # restarting: last state
                       terminated(2, VERDICT)))], REFUSED),
    ([pod(build_status(terminated(137, reason="OOMKilled")))],          # no message
     "the build exited with code 137 (OOMKilled) and no verdict"),
    ([pod(build_status(terminated(1, "Traceback ...\nMemoryError")))],  # no verdict in it
     "the build exited with code 1 (Error) and no verdict"),
    ([pod(build_status(terminated(1, "other"), name="sidecar"))], None),  # not the build
    ([pod(build_status({"running": {}})),
      pod(build_status(terminated(2, VERDICT)))], REFUSED),             # any pod of the set
])
def test_build_failure(pods, failure):
    assert render.build_failure(pods) == failure
