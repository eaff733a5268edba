"""The agent's lookups answer with Triton's texts, the field named after them."""

from __future__ import annotations

import pytest

from tiered.agent.repository import ModelEntry, ModelRepository, ModelState
from tiered.errors import NotFound, Unavailable
from tiered.profiles import load_profile


@pytest.fixture
def repository(tmp_path):
    return ModelRepository(tmp_path, load_profile("edge"))


def test_an_unknown_model_is_not_found_in_tritons_words(repository):
    with pytest.raises(NotFound) as raised:
        repository.get("nope")
    assert str(raised.value) == "Request for unknown model: 'nope' is not found (model_name)"


@pytest.mark.parametrize("state", [ModelState.LOADING, ModelState.UNLOADING])
def test_a_model_without_a_ready_version_has_no_available_versions(repository, state):
    repository._models["m"] = ModelEntry("m", state)
    with pytest.raises(Unavailable) as raised:
        repository.get("m")
    assert str(raised.value) == ("Request for unknown model: 'm' has no available versions "
                                 f"(model_name: it is {state.value.lower()})")
