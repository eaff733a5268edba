"""Chat messages to a prompt: the model's own template where it carries one
(tokenizer_config.json, named templates, chat_template.jinja), the plain one
where not; bad messages refused naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tiered.agent.generation import parse_request
from tiered.engines.generative.chat import ChatTemplate, read_messages
from tiered.errors import ConfigError, InvalidArgument

HELLO = [{"role": "user", "content": "hello"}]


def test_without_a_template_the_plain_one_answers_as_the_assistant(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    prompt = ChatTemplate.of(tmp_path).render(
        [{"role": "system", "content": "be brief"}, *HELLO])
    assert prompt == "system: be brief\nuser: hello\nassistant:"


@pytest.mark.parametrize("layout", ["string", "named", "jinja file"])
def test_the_models_template_is_found_where_checkpoints_keep_it(tmp_path, layout):
    source = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}>"
    config: dict = {"bos_token": {"content": "<s>"}}
    if layout == "string":
        config["chat_template"] = source
    elif layout == "named":
        config["chat_template"] = [{"name": "tool_use", "template": "x"},
                                   {"name": "default", "template": source}]
    else:
        (tmp_path / "chat_template.jinja").write_text(source)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.of(tmp_path).render(HELLO) == "<s>[user] hello>"


def test_a_template_that_does_not_parse_fails_the_load_naming_its_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(ConfigError, match="tokenizer_config.json: the chat template"):
        ChatTemplate.of(tmp_path)


def test_the_sandbox_keeps_a_template_from_the_interpreter():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidArgument, match="chat template"):
        template.render(HELLO)


@pytest.mark.parametrize(("messages", "field"), [
    ("not json", "messages: not JSON"),
    ([], "messages: expected a list"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\].role"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content: expected text"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
])
def test_bad_messages_are_refused_naming_the_field(messages, field):
    with pytest.raises(InvalidArgument, match=field):
        read_messages(messages if isinstance(messages, str) else json.dumps(messages))


def test_text_parts_are_joined():
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert read_messages(parts) == [{"role": "user", "content": "ab"}]


def test_a_request_gives_a_prompt_or_messages_not_both():
    chat = parse_request({}, {"messages": json.dumps(HELLO)}, "m")
    assert chat.prompt == "user: hello\nassistant:"
    with pytest.raises(InvalidArgument, match="messages: given with text_input"):
        parse_request({"text_input": np.array([b"hi"], dtype=object)},
                      {"messages": json.dumps(HELLO)}, "m")
