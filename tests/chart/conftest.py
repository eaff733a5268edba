"""Renders of the chart shared by the chart tests (helm runs once per render)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chart import helm

# TLS with client auth and a server name, and a pull secret: the chart's widest render.
FULL_VALUES: dict[str, Any] = {
    "tls": {"enabled": True, "secretName": "tiered-tls", "clientAuth": True,
            "serverName": "tiered-agents.tiered-system.svc"},
    "imagePullSecrets": [{"name": "registry"}],
}


@pytest.fixture(scope="session")
def helm_binary():
    return helm.helm_binary()


@pytest.fixture(scope="session")
def default_render(helm_binary, tmp_path_factory) -> list[dict[str, Any]]:
    return helm.render(None, tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def full_render(helm_binary, tmp_path_factory) -> list[dict[str, Any]]:
    return helm.render(FULL_VALUES, tmp_path_factory.mktemp("full"))


@pytest.fixture(scope="session")
def insecure_render(helm_binary, tmp_path_factory) -> list[dict[str, Any]]:
    """TLS off: plaintext everywhere, said explicitly (--insecure)."""
    return helm.render({"tls": {"enabled": False}}, tmp_path_factory.mktemp("insecure"))


# The default render has TLS with the certificates the chart makes; the full
# one, Secrets of the user's own.
@pytest.fixture(scope="session", params=["default", "full", "insecure"])
def any_render(request) -> list[dict[str, Any]]:
    return request.getfixturevalue(f"{request.param}_render")
