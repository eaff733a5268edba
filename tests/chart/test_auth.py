"""Bearer tokens in the chart: the router's (router.auth), mounted into its
pods, and the agents' (agents.auth), which reach the pods the controller makes
through the agent-pods ConfigMap, read back here with the controller's own
loader and renderer. Off by default."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.chart import helm
from tests.chart.test_chart import container, fullname, mounts, notes_for, one, volumes
from tests.chart.test_pod_settings import agent_pods, agent_pods_checksum, edge_workload, router
from tiered.controller.kube import render

AUTH: dict[str, Any] = {
    "router": {"auth": {"inferenceTokenSecret": "client-tokens",
                        "agentTokenSecret": "agent-tokens"}},
    "agents": {"auth": {"inferenceTokenSecret": "agent-tokens",
                        "adminTokenSecret": "agent-admins", "adminTokenKey": "tokens"}},
}
ROUTER_FILES = {"--inference-token-file": ("client-tokens", "tokens"),
                "--agent-token-file": ("agent-tokens", "token")}


@pytest.fixture(scope="module")
def with_tokens(helm_binary, tmp_path_factory):
    return helm.render(AUTH, tmp_path_factory.mktemp("auth"))


def secret_file(workload: dict[str, Any], c: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret, key) of the file at `path` in container `c`, as its mounts give it."""
    file = PurePosixPath(path)
    mount = mounts(c)[str(file.parent)]
    assert mount["readOnly"] is True
    secret = volumes(workload)[mount["name"]]["secret"]
    (item,) = secret["items"]  # the one key, not the whole Secret
    assert item["path"] == file.name
    return secret["secretName"], item["key"]


def flag_files(args: list[str], flags) -> dict[str, str]:
    return {flag: args[args.index(flag) + 1] for flag in flags if flag in args}


# ---- off by default ---------------------------------------------------------------

def test_by_default_nothing_requires_or_presents_a_token(default_render, tmp_path):
    c = container(router(default_render), "router")
    assert flag_files(c["args"], ROUTER_FILES) == {}
    assert not [v for v in volumes(router(default_render)).values()
                if "secret" in v and v["name"] != "tls"]
    config_map = one(default_render, "ConfigMap", f"{fullname()}-agent-pods")
    assert "auth" not in yaml.safe_load(config_map["data"]["agent-pods.yaml"])
    assert agent_pods(default_render, tmp_path).auth == render.AgentAuth()


# ---- the router ---------------------------------------------------------------------

def test_the_router_reads_each_token_file_from_its_secret(with_tokens, default_render):
    deployment = router(with_tokens)
    c = container(deployment, "router")
    files = flag_files(c["args"], ROUTER_FILES)
    assert {flag: secret_file(deployment, c, path) for flag, path in files.items()} == \
        ROUTER_FILES
    default = container(router(default_render), "router")["args"]
    assert [a for a in c["args"] if a not in {*files, *files.values()}] == default
    for name in ("inference-tokens", "agent-token"):
        assert volumes(deployment)[name]["secret"]["defaultMode"] == 0o440


def test_each_router_token_can_be_set_alone(tmp_path, helm_binary):
    rendered = helm.render({"router": {"auth": {"inferenceTokenSecret": "client-tokens",
                                                "inferenceTokenKey": "clients"}}}, tmp_path)
    deployment = router(rendered)
    c = container(deployment, "router")
    files = flag_files(c["args"], ROUTER_FILES)
    assert list(files) == ["--inference-token-file"]
    assert secret_file(deployment, c, files["--inference-token-file"]) == (
        "client-tokens", "clients")
    assert "agent-token" not in volumes(deployment)


# ---- the agents, through the controller ----------------------------------------------

def test_the_agents_token_secrets_reach_the_pods_the_controller_makes(with_tokens, tmp_path):
    pods = agent_pods(with_tokens, tmp_path)
    assert pods.auth == render.AgentAuth(inference=render.SecretFile("agent-tokens", "tokens"),
                                         admin=render.SecretFile("agent-admins", "tokens"))
    workload = edge_workload(pods)
    kubernetes_validate.validate(workload, helm.KUBE_VERSION, strict=True)
    agent = container(workload, "agent")
    files = flag_files(agent["command"], ("--inference-token-file", "--admin-token-file"))
    assert {flag: secret_file(workload, agent, path) for flag, path in files.items()} == {
        "--inference-token-file": ("agent-tokens", "tokens"),
        "--admin-token-file": ("agent-admins", "tokens")}


def test_a_change_of_the_agents_tokens_restarts_the_controller(with_tokens, default_render):
    assert agent_pods_checksum(with_tokens) != agent_pods_checksum(default_render)


def test_agents_requiring_a_token_need_the_router_to_present_one(tmp_path, helm_binary):
    agents_only = {"agents": {"auth": {"inferenceTokenSecret": "agent-tokens"}}}
    refused = helm.run_helm(helm.template_args(), agents_only, tmp_path)
    assert refused.returncode != 0
    assert "agents.auth.inferenceTokenSecret" in refused.stderr
    assert "set router.auth.agentTokenSecret" in refused.stderr
    # Admin tokens alone ask nothing of the router.
    helm.render({"agents": {"auth": {"adminTokenSecret": "agent-admins"}}}, tmp_path)


def test_the_render_with_tokens_validates_strictly_against_kubernetes(with_tokens):
    for obj in with_tokens:
        kubernetes_validate.validate(obj, helm.KUBE_VERSION, strict=True)


def test_the_notes_say_which_tokens_the_router_takes(tmp_path, helm_binary):
    said = "the router takes inference only with one of the tokens in Secret"
    notes = notes_for(AUTH, tmp_path / "auth")
    assert f'{said} "client-tokens"\n(key "tokens")' in notes
    assert said not in notes_for({}, tmp_path / "open")
