"""The user's verbs against a real local store: artifact pinning, multi-document
apply, reading YAML, the `tiered get` row and the manual rollout verbs."""

from __future__ import annotations

import copy
import hashlib

import pytest
import yaml

from tiered.cli.model_lines import analysis_lines, summary_row
from tiered.controller import verbs
from tiered.controller.pinning import checked, pin_artifact, read_documents
from tiered.controller.reconciler import decode_status
from tiered.controller.store import StateStore
from tiered.controller.verbs import apply_file, rollout_verb
from tiered.errors import ConfigError, Conflict, InvalidArgument
from tiered.rollout import engine
from tiered.rollout.spec import as_resource, load_tiered_model
from tiered.rollout.status import AnalysisRun, MetricResult, RolloutStatus, TieredModelStatus
from tiered.rollout.wire import to_plain

SHA = "ab" * 32
NOW = 2000.0
MODEL_BYTES = b"not really onnx, but bytes with a digest\n" * 10
MODEL_SHA = hashlib.sha256(MODEL_BYTES).hexdigest()
STAGES = [{"name": "edge-10", "weights": {"edge": 10}},
          {"name": "half", "weights": {"edge": 50, "regional": 50}}]


def flat(name="digits", artifact=None, **extra):
    return {"name": name,
            "artifact": artifact or {"uri": "/models/digits.onnx", "sha256": SHA},
            "tiers": {"edge": {}, "regional": {}},
            "rollout": {"stages": copy.deepcopy(STAGES)}, **extra}


def kube(name="digits", artifact=None):
    spec = flat(name, artifact)
    del spec["name"]
    return {"apiVersion": "tiered.dev/v1alpha1", "kind": "TieredModel",
            "metadata": {"name": name, "labels": {"team": "ml"}}, "spec": spec}


@pytest.fixture
def base(tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.onnx").write_bytes(MODEL_BYTES)
    return tmp_path


@pytest.fixture
def store(tmp_path):
    with StateStore(tmp_path / "state" / "state.db") as opened:
        yield opened


# --- pin_artifact -------------------------------------------------------------


def artifact_of(document):
    return document.get("spec", document)["artifact"]


@pytest.mark.parametrize("form", [flat, kube])
def test_pin_relative_paths_absolute_and_sha_filled(base, form):
    (base / "data").mkdir()
    (base / "data" / "calib.npz").write_bytes(b"calibration")
    (base / "data" / "eval.npz").write_bytes(b"eval")
    document = form(artifact={"uri": "models/m.onnx", "calibration": "data/calib.npz",
                              "eval": "./data/../data/eval.npz"})
    original = copy.deepcopy(document)
    pinned = pin_artifact(document, base, "f.yaml")
    assert artifact_of(pinned) == {
        "uri": str((base / "models" / "m.onnx").resolve()),
        "calibration": str((base / "data" / "calib.npz").resolve()),
        "eval": str((base / "data" / "eval.npz").resolve()),
        "sha256": MODEL_SHA,
        "calibration_sha256": hashlib.sha256(b"calibration").hexdigest(),
        "eval_sha256": hashlib.sha256(b"eval").hexdigest(),
    }
    assert document == original  # the caller's document is not changed
    assert {k: v for k, v in pinned.items() if k not in ("artifact", "spec")} == {
        k: v for k, v in original.items() if k not in ("artifact", "spec")}
    load_tiered_model(pinned)  # and it is a valid spec


@pytest.mark.parametrize("form", [flat, kube])
def test_pin_keeps_matching_sha(base, form):
    pinned = pin_artifact(form(artifact={"uri": "models/m.onnx", "sha256": MODEL_SHA}),
                          base, "f.yaml")
    assert artifact_of(pinned)["sha256"] == MODEL_SHA


@pytest.mark.parametrize("form", [flat, kube])
def test_pin_wrong_sha_raises_naming_artifact_sha256(base, form):
    where = r"f\.yaml\[1\]\.spec" if form is kube else r"f\.yaml\[1\]"
    with pytest.raises(ConfigError, match=rf"^{where}\.artifact\.sha256: ") as info:
        pin_artifact(form(artifact={"uri": "models/m.onnx", "sha256": SHA}), base,
                     "f.yaml[1]")
    assert MODEL_SHA in str(info.value) and SHA in str(info.value)


def test_pin_a_checkpoint_directory_with_the_digest_of_its_files(base):
    """A directory is pinned with sha256_tree's digest, which the build checks:
    another file's bytes give another digest, and a stale one is refused."""
    from tiered.files import sha256_tree

    checkpoint = base / "models" / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    (checkpoint / "model.safetensors").write_bytes(MODEL_BYTES)
    pinned = pin_artifact(kube(artifact={"uri": "models/ckpt"}), base, "f")
    digest = artifact_of(pinned)["sha256"]
    assert digest == sha256_tree(checkpoint) and artifact_of(pinned)["uri"] == str(checkpoint)
    (checkpoint / "model.safetensors").write_bytes(MODEL_BYTES + b"x")
    with pytest.raises(ConfigError, match=r"^f\.spec\.artifact\.sha256: .*ckpt has sha256"):
        pin_artifact(kube(artifact={"uri": "models/ckpt", "sha256": digest}), base, "f")


@pytest.mark.parametrize("form", [flat, kube])
def test_pin_missing_file_without_sha_raises_naming_artifact_uri(base, form):
    where = r"f\.yaml\.spec" if form is kube else r"f\.yaml"
    with pytest.raises(ConfigError, match=rf"^{where}\.artifact\.uri: no such file: .*missing\.onnx"):
        pin_artifact(form(artifact={"uri": "missing.onnx"}), base, "f.yaml")


@pytest.mark.parametrize("form", [flat, kube])
def test_pin_missing_file_with_sha_only_made_absolute(base, form):
    pinned = pin_artifact(form(artifact={"uri": "later.onnx", "sha256": SHA}), base, "f")
    assert artifact_of(pinned) == {"uri": str((base / "later.onnx").resolve()),
                                   "sha256": SHA}


@pytest.mark.parametrize("form", [flat, kube])
def test_pin_leaves_uris_with_a_scheme(base, form):
    artifact = {"uri": "s3://bucket/m.onnx", "sha256": SHA,
                "calibration": "https://example.com/c.npz", "calibration_sha256": SHA,
                "eval": "file:///data/e.npz", "eval_sha256": SHA}
    pinned = pin_artifact(form(artifact=dict(artifact)), base, "f")
    assert artifact_of(pinned) == artifact


def test_calibration_and_eval_files_are_pinned_like_the_artifact(base):
    (base / "c.npz").write_bytes(b"calibration")
    current = as_resource(flat(artifact={"uri": "models/m.onnx", "calibration": "c.npz"}))
    pinned = pin_artifact(current, base, "f")  # keys as the current version spells them
    assert artifact_of(pinned)["calibrationSha256"] == hashlib.sha256(b"calibration").hexdigest()
    load_tiered_model(pinned)
    with pytest.raises(ConfigError, match=r"artifact\.calibration_sha256: .*c\.npz has sha256 "):
        pin_artifact(flat(artifact={"uri": "models/m.onnx", "calibration": "c.npz",
                                    "calibration_sha256": SHA}), base, "f")
    with pytest.raises(ConfigError, match=r"artifact\.eval: https://example\.com/e\.npz is "
                       r"not on this machine.*give artifact\.eval_sha256"):
        pin_artifact(flat(artifact={"uri": "models/m.onnx", "eval": "https://example.com/e.npz"}),
                     base, "f")
    with pytest.raises(ConfigError, match=r"artifact\.eval: no such file"):
        pin_artifact(flat(artifact={"uri": "models/m.onnx", "eval": "missing.npz"}), base, "f")


def test_pin_scheme_uri_without_sha_raises(base):
    with pytest.raises(ConfigError, match=r"artifact\.uri: s3://bucket/m\.onnx is not on this "
                       r"machine.*give artifact\.sha256"):
        pin_artifact(flat(artifact={"uri": "s3://bucket/m.onnx"}), base, "f")


@pytest.mark.parametrize("form", [flat, kube])
def test_a_mistyped_field_is_named_before_the_artifact_is_looked_at(base, form):
    document = form(artifact={"uri": "missing.onnx"})
    spec = document.get("spec", document)
    spec["tiers"]["edge"]["replicaz"] = 2  # the typo; the artifact is missing too
    with pytest.raises(ConfigError, match="replicaz") as caught:
        checked(document, base, "f.yaml")
    assert "artifact" not in str(caught.value)
    spec["tiers"]["edge"].pop("replicaz")
    spec["artifact"] = {"uri": "models/m.onnx"}
    model, pinned = checked(document, base, "f.yaml")
    assert artifact_of(pinned)["sha256"] == MODEL_SHA and model.name == "digits"


def test_pin_absolute_path_stays(base):
    target = base / "models" / "m.onnx"
    pinned = pin_artifact(flat(artifact={"uri": str(target)}), base / "elsewhere", "f")
    assert artifact_of(pinned) == {"uri": str(target.resolve()), "sha256": MODEL_SHA}


@pytest.mark.parametrize("document", [
    {"name": "digits"},
    {"name": "digits", "artifact": "models/m.onnx"},
    {"apiVersion": "tiered.dev/v1alpha1", "kind": "TieredModel", "spec": {}},
])
def test_pin_without_artifact_mapping_returns_document(base, document):
    assert pin_artifact(document, base, "f") == document


# --- read_documents / apply_file ------------------------------------------------


def write_yaml(path, *documents):
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    return path


def test_apply_file_created_unchanged_configured(base, store):
    path = write_yaml(base / "models.yaml",
                      flat("alpha", artifact={"uri": "models/m.onnx"}),
                      kube("beta", artifact={"uri": "models/m.onnx"}))
    assert apply_file(store, path) == [("alpha", "created"), ("beta", "created")]
    stored = store.get("beta").spec
    assert stored["spec"]["artifact"] == {"uri": str((base / "models/m.onnx").resolve()),
                                          "sha256": MODEL_SHA}
    assert stored["metadata"]["labels"] == {"team": "ml"}
    # Stored in the current API version: the v1alpha1 and flat documents converted.
    assert stored["apiVersion"] == store.get("alpha").spec["apiVersion"] == "tiered.dev/v1alpha2"
    assert apply_file(store, path) == [("alpha", "unchanged"), ("beta", "unchanged")]
    assert store.get("alpha").generation == 1
    changed = flat("alpha", artifact={"uri": "models/m.onnx"})
    changed["tiers"]["edge"] = {"replicas": 2}
    write_yaml(path, changed, kube("beta", artifact={"uri": "models/m.onnx"}))
    assert apply_file(store, path) == [("alpha", "configured"), ("beta", "unchanged")]
    assert store.get("alpha").generation == 2
    assert store.get("alpha").spec["spec"]["tiers"]["edge"] == {"replicas": 2}


@pytest.mark.parametrize(("second", "match"), [
    ({"name": "beta", "tiers": {}}, r"models\.yaml\[1\]"),                 # invalid spec
    (flat("beta", artifact={"uri": "models/m.onnx", "sha256": SHA}),
     r"models\.yaml\[1\]\.artifact\.sha256"),                             # wrong digest
    (flat("beta", artifact={"uri": "nowhere.onnx"}), r"models\.yaml\[1\]\.artifact\.uri"),
])
def test_apply_file_invalid_second_document_stores_nothing(base, store, second, match):
    path = write_yaml(base / "models.yaml", flat("alpha"), second)
    with pytest.raises(ConfigError, match=match):
        apply_file(store, path)
    assert store.list() == []


def test_apply_file_invalid_second_document_keeps_previous_first(base, store):
    path = write_yaml(base / "models.yaml", flat("alpha"))
    apply_file(store, path)
    write_yaml(path, flat("alpha", routing={"slo_ms": 5}), {"name": "Bad Name!"})
    with pytest.raises(ConfigError):
        apply_file(store, path)
    record = store.get("alpha")
    assert (record.generation, record.revision) == (1, 1)
    assert "routing" not in record.spec


def test_read_documents_skips_empty_documents(base):
    path = base / "d.yaml"
    path.write_text("---\na: 1\n---\n---\nb: 2\n")
    assert read_documents(path) == [{"a": 1}, {"b": 2}]


@pytest.mark.parametrize(("text", "match"), [
    ("a: [1, 2\n", r"d\.yaml: invalid YAML"),
    ("a: 1\n---\n- x\n- y\n", r"d\.yaml: document 2: expected a mapping, got list"),
    ("just a string\n", r"d\.yaml: document 1: expected a mapping, got str"),
])
def test_read_documents_errors(base, text, match):
    path = base / "d.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        read_documents(path)


def test_read_documents_missing_file(base):
    with pytest.raises(ConfigError, match=r"nope\.yaml: cannot read"):
        read_documents(base / "nope.yaml")


# --- summary_row -------------------------------------------------------------


def applied(store, name="digits", status=None, message=""):
    """A stored model whose status has this rollout and message."""
    record = store.apply(name, flat(name))
    if status is not None or message:
        written = TieredModelStatus(rollout=status, message=message)
        record = store.write_status(name, record.revision, status=to_plain(written))
    return record


SPEC = load_tiered_model(flat())


def test_summary_row_pending(store):
    row = summary_row(applied(store, message="building version 1"))
    assert row == {"NAME": "digits", "READY": "-", "PHASE": "Pending", "STAGE": "-",
                   "STABLE": "-", "CANARY": "-", "WEIGHTS": "-",
                   "MESSAGE": "building version 1"}


@pytest.mark.parametrize(("status", "stage", "canary", "weights", "phase"), [
    (engine.start(SPEC, 1, 2, NOW), "1/2 edge-10", "v2", "edge=10%", "Progressing"),
    (engine.promote(SPEC, engine.start(SPEC, 1, 2, NOW), NOW).status, "2/2 half", "v2",
     "edge=50% regional=50%", "Progressing"),
    (engine.pause(SPEC, engine.start(SPEC, 1, 2, NOW), NOW).status, "1/2 edge-10", "v2",
     "edge=10%", "Paused"),
    (engine.promote(SPEC, engine.start(SPEC, 1, 2, NOW), NOW, full=True).status, "-", "-",
     "-", "Promoted"),
])
def test_summary_row_with_status(store, status, stage, canary, weights, phase):
    row = summary_row(applied(store, status=status))
    assert row["PHASE"] == phase
    assert row["STAGE"] == stage
    assert row["CANARY"] == canary
    assert row["WEIGHTS"] == weights
    assert row["STABLE"] == ("v2" if phase == "Promoted" else "v1")
    assert row["MESSAGE"] == status.message  # the record's own message is empty


def test_summary_row_prefers_record_message(store):
    row = summary_row(applied(store, status=engine.start(SPEC, 1, 2, NOW),
                              message="build failed"))
    assert row["MESSAGE"] == "build failed"


# --- rollout_verb --------------------------------------------------------------


def clock():
    return NOW + 30.0


def live(store, **changes):
    status = engine.start(SPEC, 1, 2, NOW)
    if changes.get("paused"):
        status = engine.pause(SPEC, status, NOW).status
    return applied(store, status=status)


def after(store, record, decision, action):
    """The stored status is the decision's; one snapshot was recorded."""
    now = store.get("digits")
    assert now.revision == record.revision + 1
    status = decode_status("digits", now.status)
    assert status.rollout == decision.status
    assert status.message == decision.reason
    assert status.artifacts == decode_status("digits", record.status).artifacts
    history = store.history("digits")
    assert len(history) == 1
    snap = history[0][2]
    assert (snap["action"], snap["phase"], snap["reason"]) == (
        action, decision.status.phase, decision.reason)
    return status.rollout


@pytest.mark.parametrize(("verb", "paused", "full", "action", "phase", "stage", "stable"), [
    ("pause", False, False, "pause", "Paused", 0, 1),
    ("resume", True, False, "resume", "Progressing", 0, 1),
    ("promote", False, False, "advance", "Progressing", 1, 1),
    ("promote", False, True, "promote", "Promoted", 0, 2),
    ("abort", False, False, "abort", "Aborted", 0, 1),
])
def test_rollout_verb(store, verb, paused, full, action, phase, stage, stable):
    record = live(store, paused=paused)
    decision = rollout_verb(store, "digits", verb, full=full, now=clock)
    assert decision.action == action
    status = after(store, record, decision, action)
    assert status.phase == phase
    assert status.stage_index == stage
    assert status.stable_version == stable
    assert status.paused is (phase == "Paused")


def test_resume_restarts_stage_clock(store):
    live(store, paused=True)
    rollout_verb(store, "digits", "resume", now=clock)
    assert decode_status("digits", store.get("digits").status).rollout.stage_started_at == clock()


def test_promote_full_says_so(store):
    live(store)
    decision = rollout_verb(store, "digits", "promote", full=True, now=clock)
    assert decision.reason == "promoted version 2 by hand (full)"
    assert decode_status("digits", store.get("digits").status).rollout.canary_version is None


def test_promote_twice_reaches_promoted(store):
    live(store)
    rollout_verb(store, "digits", "promote", now=clock)
    decision = rollout_verb(store, "digits", "promote", now=clock)
    assert decision.status.phase == "Promoted"
    assert decision.status.stable_version == 2
    assert [s["action"] for _, _, s in store.history("digits")] == ["advance", "promote"]


def test_unknown_verb_is_config_error_and_writes_nothing(store):
    record = live(store)
    with pytest.raises(ConfigError, match=r"verb: 'restart' is not one of pause, resume"):
        rollout_verb(store, "digits", "restart", now=clock)
    assert store.get("digits") == record
    assert store.history("digits") == []


def test_verb_without_status_is_config_error(store):
    record = applied(store)
    with pytest.raises(ConfigError, match="digits: has no status yet"):
        rollout_verb(store, "digits", "pause", now=clock)
    assert store.get("digits") == record
    assert store.history("digits") == []


def test_verb_on_finished_rollout_writes_nothing(store):
    record = applied(store, status=engine.abort(SPEC, engine.start(SPEC, 1, 2, NOW),
                                                NOW).status)
    with pytest.raises(InvalidArgument, match="Aborted"):
        rollout_verb(store, "digits", "promote", now=clock)
    assert store.get("digits") == record
    assert store.history("digits") == []


def test_verb_retries_after_a_conflicting_write(store, monkeypatch):
    live(store)
    real = store.write_status
    calls = []

    def controller_wrote_first(name, revision, **kwargs):
        calls.append(revision)
        if len(calls) == 1:  # the controller writes between our read and our write
            current = store.get(name)
            real(name, current.revision, status={**current.status,
                                                 "message": "controller pass"})
        return real(name, revision, **kwargs)

    monkeypatch.setattr(store, "write_status", controller_wrote_first)
    decision = rollout_verb(store, "digits", "pause", now=clock)
    assert calls == [2, 3]  # re-read after the conflict
    assert decode_status("digits", store.get("digits").status).rollout.phase == "Paused"
    assert decision.status.phase == "Paused"
    assert len(store.history("digits")) == 1


def test_verb_gives_up_after_retries(store, monkeypatch):
    live(store)

    def always_conflict(name, revision, **kwargs):
        raise Conflict("busy")

    monkeypatch.setattr(store, "write_status", always_conflict)
    monkeypatch.setattr(verbs, "CONFLICT_RETRIES", 3)
    with pytest.raises(Conflict, match="kept writing"):
        rollout_verb(store, "digits", "abort", now=clock)
    assert store.history("digits") == []


def test_analysis_lines_name_each_metric_and_tier():
    assert analysis_lines(None) == []
    assert analysis_lines(RolloutStatus(stable_version=1)) == []
    run = AnalysisRun(7, "Failed", (
        MetricResult("latency_p95", "Successful", "no regression", tier="edge"),
        MetricResult("energy_per_inference", "Failed", "canary uses more", tier="regional"),
        MetricResult("agreement", "Inconclusive", "too few shadowed requests")))
    assert analysis_lines(RolloutStatus(stable_version=1, last_analysis=run)) == [
        "last analysis: Failed",
        "  latency_p95 on edge: Successful: no regression",
        "  energy_per_inference on regional: Failed: canary uses more",
        "  agreement: Inconclusive: too few shadowed requests"]


def test_a_status_step_says_where_each_energy_figure_came_from():
    """Kubernetes keeps a rollout's steps in its status: their lines read as
    the local store's snapshots do, with each figure's energy source."""
    from tiered.controller.plan import _step
    from tiered.rollout.progress import progress_line
    from tiered.rollout.snapshot import Figures, StageFigures, from_history
    from tiered.rollout.spec import load_tiered_model
    from tiered.rollout.status import TieredModelStatus

    spec = load_tiered_model({"name": "m", "artifact": {"uri": "/m.onnx", "sha256": "a" * 64},
                              "tiers": {"edge": {}},
                              "rollout": {"stages": [{"name": "edge", "weights": {"edge": 10}}]}})
    rollout = RolloutStatus(stable_version=1, canary_version=2, phase="Progressing")
    step = _step(spec, rollout, "advance", "ok", 0.0, StageFigures(
        stable=Figures(requests=900, jpi=0.5, energy_source="nvml"),
        canary=Figures(requests=100, jpi=0.25, energy_source="model", p95_ms=None),
        agreement_compared=None))
    assert step.sources == {"jpi_stable": "nvml", "jpi_canary": "model"}
    assert "p95_canary_ms" not in step.numbers  # no figure: nothing stored
    [(t, snap)] = from_history(spec, TieredModelStatus(history=(step,)))
    line = progress_line(t, snap)
    assert ("stable n 900 p95 - ms 500.000 mJ/inf  canary n 100 p95 - ms 250.000 mJ/inf "
            "(stable nvml, canary model, estimate)  agree - (-) | advance: ok") in line, line


def test_get_keeps_each_table_cell_to_a_line(base, store, capsys):
    from tiered.cli import main

    write_yaml(base / "f.yaml", flat(artifact={"uri": "models/m.onnx"}))
    verbs.apply_file(store, base / "f.yaml")
    record = store.get("digits")
    store.write_status("digits", record.revision, status={"message": "x" * 500})
    assert main(["get", "--state", str(base / "state")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(len(line) < 200 for line in lines)  # header, rule, row
    assert lines[2].rstrip().endswith("x...")
