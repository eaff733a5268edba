"""OpenAI's API on a real agent and a real router, driven by the `openai`
Python client unchanged: /v1/models, completions and chat completions,
whole and streamed, with usage counted in the model's own tokens and the
model's own chat template; what is not served is refused naming the field.
The router's answers go through its routing table like any request."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from tests.conftest import add_generative  # noqa: E402
from tests.generation import PROMPT  # noqa: E402
from tiered.agent.repository import model_file, write_config  # noqa: E402
from tiered.engines.generative.chat import ChatTemplate  # noqa: E402
from tiered.engines.generative.text import open_tokenizer  # noqa: E402
from tiered.local.processes import AgentProcess, RouterProcess  # noqa: E402
from tiered.models import zoo  # noqa: E402

# The model's own template (tags no plain template writes); a system message
# is refused by it, as some models' templates refuse roles they lack.
TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}"
            "{{ raise_exception('this model takes no system message') }}{% endif %}"
            "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CHAT = [{"role": "user", "content": "which tier answers first?"},
        {"role": "assistant", "content": "the edge"},
        {"role": "user", "content": "and then?"}]


@pytest.fixture(scope="module")
def repository(generative_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("openai-repository")
    add_generative(root, "tiny", generative_model, {"engine": {"max_sequences": 4}})
    config_path = root / "tiny" / "1" / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    zoo.mlp(model_file(root, "mlp", 1), seed=1)
    write_config(root, "mlp", {"max_batch_size": 16})
    return root


@pytest.fixture(scope="module")
def agent(repository):
    process = AgentProcess("edge", repository).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def router(agent, tmp_path_factory):
    table = tmp_path_factory.mktemp("openai-router") / "routing.json"
    table.write_text(json.dumps({"version": 1, "models": {
        name: {"tiers": {"edge": {"agents": [agent.address]}}} for name in ("tiny", "mlp")}}))
    with RouterProcess(table) as process:
        yield process


@pytest.fixture(scope="module")
def tokenizer(repository):
    return open_tokenizer("onnxruntime-genai", repository / "tiny" / "1")


@pytest.fixture(params=["agent", "router"])
def server(request, agent, router):
    process = agent if request.param == "agent" else router
    return openai.OpenAI(base_url=f"http://{process.http_address}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def triton_generate(process, prompt: str, max_tokens: int) -> str:
    """The same greedy generation through Triton's generate extension."""
    body = json.dumps({"text_input": prompt, "parameters": {"max_tokens": max_tokens}})
    request = urllib.request.Request(
        f"http://{process.http_address}/v2/models/tiny/generate", data=body.encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["text_output"]


def test_models_lists_the_models_that_generate(server):
    assert [model.id for model in server.models.list()] == ["tiny"]


def test_a_completion_is_the_generate_extensions_text_with_its_usage(server, agent, tokenizer):
    answer = server.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                       temperature=0)
    (choice,) = answer.choices
    assert choice.text == triton_generate(agent, PROMPT, 8)
    assert choice.finish_reason == "length"  # random weights: no end before max_tokens
    assert answer.object == "text_completion" and answer.model == "tiny"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == \
        (len(tokenizer.encode(PROMPT)), 8)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 8


def test_a_streamed_completion_sends_the_same_text_a_token_a_chunk(server):
    whole = server.completions.create(model="tiny", prompt=PROMPT, max_tokens=6)
    chunks = list(server.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6 and "".join(texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_a_chat_is_rendered_by_the_models_own_template(server, repository, tokenizer):
    # its special tokens as the model's tokenizer_config.json has them
    prompt = ChatTemplate.of(repository / "tiny" / "1").render(CHAT)
    assert prompt.startswith("<|user|>which tier answers first?")
    assert prompt.endswith("<|user|>and then?<|assistant|>") or \
        prompt.endswith("</s><|assistant|>")
    answer = server.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5)
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert answer.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert answer.usage.completion_tokens == 5 and choice.finish_reason == "length"
    streamed = list(server.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                                   stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in streamed) == choice.message.content


def test_what_is_not_served_is_refused_naming_the_field(server):
    with pytest.raises(openai.BadRequestError, match="n: 2 is not served"):
        server.completions.create(model="tiny", prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError, match="this model takes no system message"):
        server.chat.completions.create(model="tiny", messages=[
            {"role": "system", "content": "be brief"}, *CHAT])
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
        server.chat.completions.create(model="tiny", messages=[{"role": "x", "content": "?"}])
    with pytest.raises(openai.NotFoundError, match="Request for unknown model: 'nope'"):
        server.completions.create(model="nope", prompt=PROMPT)
