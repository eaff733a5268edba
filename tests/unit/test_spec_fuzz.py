"""Fuzzing TieredModel documents: random mutations of examples/digits.yaml
(wrong types, missing and unknown keys, out-of-range numbers, NaN/inf, huge
lists, deep nesting, non-mapping documents, YAML that does not parse), through
`load_tiered_model` and through `read_documents`/`apply_file` into a real
StateStore. Every document either loads or is refused with a ConfigError whose
message starts with the path of a field; a refused file stores nothing.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered.controller.pinning import read_documents
from tiered.controller.store import StateStore
from tiered.controller.verbs import apply_file
from tiered.errors import ConfigError
from tiered.rollout.spec import TieredModel, load_tiered_model
from tiered.rollout.wire import to_plain

BASE = yaml.safe_load((Path(__file__).parents[2] / "examples" / "digits.yaml").read_text())
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
KEY = r"[A-Za-z0-9_-]+"
# TieredModel, then .field / .mapping-key / [index] steps, then ": ". A check on a
# mapping's values reports "stages[0]: weights['edge']: ..." (the parent's path,
# then the key), which is accepted too.
PATH = re.compile(rf"^(?P<path>TieredModel(\.{KEY}|\[\d+\])*)(: [a-z_]+\['{KEY}'\])?: \S")

keys = st.from_regex(rf"\A{KEY}\Z").filter(lambda k: len(k) <= 12)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**2000), 2**2000),
    st.sampled_from([10**400, -(10**400), 2**63, 2**64, -1, 0, 1, 101, 4097, 10**6]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]),
    st.text(max_size=20), st.sampled_from(["", "edge", "regional", "datacenter", "moon",
                                           "fp16", "cascade", "rollback", "digits", "a" * 300]),
)
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)), max_leaves=12)


def deep(depth: int, leaf=1):
    for index in range(depth):
        leaf = [leaf] if index % 2 else {"a": leaf}
    return leaf


values = st.one_of(
    junk,
    st.builds(deep, st.integers(20, 120)),
    st.integers(33, 64).map(lambda n: [{"name": f"s{i}", "weights": {"edge": 1}}
                                         for i in range(n)]),  # beyond max_items
    st.integers(0, 1000).map(lambda n: ["edge"] * n),
)


def paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from paths(value, (*prefix, index))


def dotted(path) -> str:
    """A document path as the loader writes it (spec.x.y[0])."""
    text = "TieredModel"
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else f".{step}"
    return text


@st.composite
def documents(draw, base=BASE):
    """(document, mutated path or None) after one to three mutations."""
    document = copy.deepcopy(base)
    if draw(st.integers(0, 9)) == 0:  # not a mapping at all
        return draw(st.one_of(junk, st.lists(junk))), None
    if draw(st.booleans()):  # the flat form: name beside the spec keys, as in Python
        document = to_plain(load_tiered_model(document), spell=None)
    touched = None
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(paths(document))))
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        how = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if not path or how == "add":
            target = parent[path[-1]] if path else document
            if isinstance(target, dict):  # an integer key too: YAML allows one
                target[draw(st.one_of(keys, st.integers(-5, 5)))] = draw(values)
            elif isinstance(target, list):
                target.append(draw(values))
            else:
                continue
        elif how == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(values)
        touched = path if touched is None else ()
    return document, touched


def check_refusal(error: ConfigError, touched) -> None:
    message = str(error)
    assert "Traceback" not in message
    match = PATH.match(message)
    assert match, f"the message does not start with a field path: {message!r}"
    if touched:
        # The error is at the changed field, above it (a missing or unknown key,
        # a cross-field rule) or below it (a bad member of a changed value).
        where, changed = match["path"], dotted(touched[1:] if touched[0] == "spec" else touched)
        where = where.replace("TieredModel.spec", "TieredModel")
        related = changed.startswith(where) or where.startswith(changed)
        assert related or where.startswith(("TieredModel.rollout", "TieredModel.routing")), \
            f"changed {changed}, refused at {where}: {message}"


@FUZZ
@given(documents())
def test_a_mutated_spec_loads_or_is_refused_naming_the_field(case):
    document, touched = case
    try:
        model = load_tiered_model(document)
    except ConfigError as error:
        check_refusal(error, touched)
        return
    assert isinstance(model, TieredModel)


def test_the_base_spec_loads():
    assert load_tiered_model(copy.deepcopy(BASE)).name == "digits"


# --- through the user's verbs and a real store -------------------------------


@pytest.fixture
def workspace(tmp_path):
    artifact = tmp_path / "model.onnx"
    artifact.write_bytes(b"an artifact with a digest\n")
    base = copy.deepcopy(BASE)
    base["spec"]["artifact"]["uri"] = str(artifact)
    with StateStore(tmp_path / "state.db") as store:
        yield tmp_path, base, store


def snapshot(store: StateStore):
    return [(r.name, r.generation, r.spec) for r in store.list()]


# The user's verbs choke on these (see test_known_apply_file_failures): keep them
# out of the fuzz so that it keeps judging everything else.
def verbs_can_read(document) -> bool:
    if not isinstance(document, dict):
        return True
    if "spec" in document and not isinstance(document["spec"], dict):
        return False
    holder = document.get("spec", document)
    artifact = holder.get("artifact") if isinstance(holder, dict) else None
    uri = artifact.get("uri") if isinstance(artifact, dict) else None
    return not (isinstance(uri, str) and ("\0" in uri or len(uri) > 200))


yaml_garbage = st.one_of(
    st.text(max_size=200),
    st.sampled_from(["{", "[1, 2", "a: b: c", "\t- x", "key: 'unterminated", "--- !!set {a}",
                     "a: *undefined", "? [1]\n: 2", "%YAML 9.9\n---\na: 1", "- 1\n- 2",
                     "just a string", "42", "~", "---\n---\n", "a: !!binary zzz"]),
)


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_apply_file_stores_a_document_or_refuses_it_and_stores_nothing(workspace, data):
    tmp_path, base, store = workspace
    kind = data.draw(st.sampled_from(["mutated", "mutated", "pair", "garbage"]))
    if kind == "garbage":
        text = data.draw(yaml_garbage)
    else:
        document, _ = data.draw(documents(base).filter(lambda c: verbs_can_read(c[0])))
        text = yaml.safe_dump(document)
        if kind == "pair":  # a good document first: neither may be stored
            text = yaml.safe_dump(base) + "---\n" + text
    path = tmp_path / "doc.yaml"
    path.write_text(text)
    before = snapshot(store)
    try:
        read_documents(path)
        results = apply_file(store, path)
    except ConfigError as error:
        assert str(error).startswith(str(path)), str(error)
        assert "Traceback" not in str(error)
        assert snapshot(store) == before, "a refused file changed the store"
        return
    assert {name for name, _ in results} <= {r.name for r in store.list()}


@pytest.mark.parametrize("text", [
    "a: " + "[" * 700 + "]" * 700,  # RecursionError
    "a: " + "1" * 5000,  # ValueError: int beyond 4300 digits
    "a: 2020-13-45",  # ValueError: a date that is none
    "name: x\nspec: 5\n",  # TypeError in pin_artifact
    "apiVersion: tiered.dev/v1alpha1\nkind: TieredModel\nmetadata: {name: x}\nspec: abc\n",
    "name: x\nartifact: {uri: \"a\\0b\"}\n",  # ValueError: embedded null byte
    "name: x\nartifact: {uri: " + "a" * 5000 + "}\n",  # OSError: file name too long
], ids=["deep", "bigint", "date", "spec-int", "spec-str", "nul-uri", "long-uri"])
def test_known_apply_file_failures(workspace, text):
    tmp_path, _, store = workspace
    path = tmp_path / "doc.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError):
        apply_file(store, path)
    assert store.list() == []


@pytest.mark.parametrize("text", ["a: " + "[" * 700 + "]" * 700, "a: " + "1" * 5000,
                                  "a: 2020-13-45"])
def test_read_yaml_refuses_what_yaml_cannot_build(tmp_path, text):
    from tiered.settings import read_yaml

    path = tmp_path / "profile.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="invalid YAML"):
        read_yaml(path)
