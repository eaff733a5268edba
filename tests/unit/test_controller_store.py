"""The local state store on a real SQLite file: generations, revisions and
conflicts, not-found names, history order and bounds, two openers, corruption."""

from __future__ import annotations

import sqlite3

import pytest

from tiered.controller import store as store_module
from tiered.controller.host.state import StateLayout
from tiered.controller.store import StateStore
from tiered.errors import ConfigError, Conflict, NotFound

SPEC = {"name": "digits", "artifact": {"uri": "/m/digits.onnx", "sha256": "ab" * 32}}
STATUS = {"rollout": {"stable_version": 1, "phase": "Promoted"}, "message": "serving",
          "artifacts": [{"version": 1, "uri": "/m/digits.onnx", "sha256": "ab" * 32}]}


@pytest.fixture
def store(tmp_path):
    with StateStore(tmp_path / "state" / "state.db") as opened:
        yield opened


def test_apply_creates_generation_one(store):
    record = store.apply("digits", SPEC)
    assert (record.name, record.generation, record.revision) == ("digits", 1, 1)
    assert record.spec == SPEC
    assert record.status is None
    assert (store.path.parent / "state.db").is_file()  # parent folder created


def test_apply_same_spec_keeps_generation_and_revision(store):
    first = store.apply("digits", SPEC)
    again = store.apply("digits", dict(reversed(list(SPEC.items()))))  # key order ignored
    assert (again.generation, again.revision) == (1, 1)
    assert again.updated_at == first.updated_at


@pytest.mark.parametrize("changes", [1, 3])
def test_changed_spec_bumps_generation_and_revision(store, changes):
    store.apply("digits", SPEC)
    for n in range(changes):
        record = store.apply("digits", {**SPEC, "tiers": {"edge": {"replicas": n + 1}}})
    assert record.generation == 1 + changes
    assert record.revision == 1 + changes
    assert record.spec["tiers"] == {"edge": {"replicas": changes}}


def test_spec_change_keeps_status(store):
    record = store.apply("digits", SPEC)
    store.write_status("digits", record.revision, status=STATUS)
    record = store.apply("digits", {**SPEC, "x": 1})
    assert record.status == STATUS
    assert (record.generation, record.revision) == (2, 3)


def test_write_status_at_current_revision(store):
    record = store.apply("digits", SPEC)
    written = store.write_status("digits", record.revision, status=STATUS)
    assert written.status == STATUS
    assert written.revision == record.revision + 1
    assert written.generation == 1  # status writes never bump the generation
    cleared = store.write_status("digits", written.revision, status=None)
    assert cleared.status is None and cleared.revision == record.revision + 2


def test_write_status_with_stale_revision_conflicts_and_loses_nothing(store):
    record = store.apply("digits", SPEC)
    current = store.write_status("digits", record.revision, status=STATUS)
    with pytest.raises(Conflict, match=rf"changed since revision {record.revision}"):
        store.write_status("digits", record.revision, status={"message": "stale"})
    after = store.get("digits")
    assert after == current


def test_stale_revision_after_spec_change_conflicts(store):
    record = store.apply("digits", SPEC)
    store.apply("digits", {**SPEC, "x": 1})
    with pytest.raises(Conflict):
        store.write_status("digits", record.revision, status=STATUS)
    assert store.get("digits").status is None


def test_get_unknown_names_the_applied_ones(store):
    with pytest.raises(NotFound, match=r"'nope' is not applied \(applied: none\)"):
        store.get("nope")
    store.apply("digits", SPEC)
    store.apply("alpha", SPEC)
    with pytest.raises(NotFound, match=r"'nope' is not applied \(applied: alpha, digits\)"):
        store.get("nope")


def test_write_status_and_delete_unknown_raise_not_found(store):
    store.apply("digits", SPEC)
    with pytest.raises(NotFound, match="'nope'"):
        store.write_status("nope", 1, status=STATUS)
    with pytest.raises(NotFound, match="'nope'"):
        store.delete("nope")
    assert [r.name for r in store.list()] == ["digits"]


def test_list_is_sorted_by_name(store):
    for name in ("zeta", "alpha", "mid"):
        store.apply(name, SPEC)
    assert [r.name for r in store.list()] == ["alpha", "mid", "zeta"]


def test_delete_removes_model_and_its_history_only(store):
    store.apply("digits", SPEC)
    store.apply("other", SPEC)
    store.record("digits", {"n": 1}, t=1.0)
    store.record("other", {"n": 2}, t=2.0)
    store.delete("digits")
    assert [r.name for r in store.list()] == ["other"]
    with pytest.raises(NotFound):
        store.get("digits")
    assert store.history("digits") == []
    assert [s for _, _, s in store.history()] == [{"n": 2}]
    created = store.apply("digits", SPEC)  # re-applying starts afresh
    assert (created.generation, created.revision) == (1, 1)


def test_history_order_time_and_after_id(store):
    for n in range(4):
        store.record("digits", {"n": n}, t=100.0 + n)
    rows = store.history("digits")
    assert [s["n"] for _, _, s in rows] == [0, 1, 2, 3]
    assert [t for _, t, _ in rows] == [100.0, 101.0, 102.0, 103.0]
    ids = [i for i, _, _ in rows]
    assert ids == sorted(ids) and len(set(ids)) == 4
    assert [s["n"] for _, _, s in store.history("digits", after_id=ids[1])] == [2, 3]
    assert store.history("digits", after_id=ids[-1]) == []


def test_history_default_time_is_now(store, monkeypatch):
    monkeypatch.setattr(store_module.time, "time", lambda: 4242.0)
    store.record("digits", {"n": 0})
    assert store.history()[0][1] == 4242.0


def test_history_filters_by_name(store):
    for n in range(3):
        store.record("a", {"n": n})
        store.record("b", {"n": n})
    assert [s["n"] for _, _, s in store.history("a")] == [0, 1, 2]
    assert [s["n"] for _, _, s in store.history("b")] == [0, 1, 2]
    assert len(store.history()) == 6
    a_ids = {i for i, _, _ in store.history("a")}
    b_ids = {i for i, _, _ in store.history("b")}
    assert not a_ids & b_ids
    assert store.history("c") == []


def test_history_limit_keeps_the_newest(store, monkeypatch):
    monkeypatch.setattr(store_module, "HISTORY_LIMIT", 3)
    for n in range(7):
        store.record("digits", {"n": n})
    assert [s["n"] for _, _, s in store.history("digits")] == [4, 5, 6]


def test_history_limit_is_per_model(store, monkeypatch):
    monkeypatch.setattr(store_module, "HISTORY_LIMIT", 3)
    for n in range(5):
        store.record("a", {"n": n})
        store.record("b", {"n": n})
    assert [s["n"] for _, _, s in store.history("a")] == [2, 3, 4]
    assert [s["n"] for _, _, s in store.history("b")] == [2, 3, 4]


def test_two_stores_on_one_file_see_each_other(tmp_path):
    path = tmp_path / "state.db"
    with StateStore(path) as one, StateStore(path) as two:
        created = one.apply("digits", SPEC)
        assert two.get("digits") == created
        written = two.write_status("digits", created.revision, status=STATUS)
        assert one.get("digits") == written
        with pytest.raises(Conflict):  # one's copy is stale now
            one.write_status("digits", created.revision, status=None)
        two.record("digits", {"n": 1})
        assert [s for _, _, s in one.history("digits")] == [{"n": 1}]
    with StateStore(path) as reopened:  # and it all survives a restart
        assert reopened.get("digits").status == STATUS


def test_corrupt_file_gives_config_error_naming_it(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database\x00\xff" * 200)
    with pytest.raises(ConfigError, match="state.db") as info:
        StateStore(path)  # the code checks at open
    assert str(path) in str(info.value)
    assert not isinstance(info.value, sqlite3.Error)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


def test_the_state_directory_is_private_to_its_user(tmp_path):
    with StateStore(tmp_path / "fresh" / "state.db"):  # a verb before `tiered up`
        pass
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    StateLayout(shared).create()  # `tiered up` takes its directory private
    assert shared.stat().st_mode & 0o777 == 0o700
    token = StateLayout(tmp_path / "new").ensure_admin_token()
    assert (token.stat().st_mode & 0o777, token.parent.stat().st_mode & 0o777) == (0o600, 0o700)


def test_a_committed_write_survives_power_loss(store):
    # WAL with synchronous=FULL fsyncs the log at every commit (NORMAL would not).
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
