"""`tiered build`'s verdict: one JSON line out, the same value read back from
whatever text surrounds it (a process's stderr, a termination message)."""

from __future__ import annotations

import json

import pytest

from tiered.protocol.verdict import (
    KIND,
    MAX_REASON_CHARS,
    BuildVerdict,
    parse_verdict,
    read_verdict,
)

BUILT = BuildVerdict(built=True, model="digits", version=3, tier="edge",
                     reason="pass: within the threshold: top-1 agreement 0.9956",
                     installed="/models/digits/3", exit_code=0)
REFUSED = BuildVerdict(built=False, model="digits", version=4, tier="edge",
                       reason="artifact: /a.onnx has sha256 ab, not the expected cd; "
                              "refusing to build it", installed=None, exit_code=2)


def test_a_verdict_is_one_compact_json_line_that_names_its_kind() -> None:
    line = BUILT.to_json()

    assert "\n" not in line
    assert line.startswith('{"kind":"tiered.build/verdict","built":true,"model":"digits",')
    assert json.loads(line) == {"kind": KIND, "built": True, "model": "digits", "version": 3,
                                "tier": "edge", "reason": BUILT.reason,
                                "installed": "/models/digits/3", "exit_code": 0}


@pytest.mark.parametrize("verdict", [BUILT, REFUSED], ids=["built", "refused"])
def test_a_verdict_reads_back_equal(verdict) -> None:
    assert read_verdict(verdict.to_json()) == verdict
    assert parse_verdict(verdict.to_dict()) == verdict


def test_the_last_of_several_verdicts_is_read() -> None:
    text = "\n".join([REFUSED.to_json(), "tiered build: wrote /models/digits/3.", BUILT.to_json(),
                      ""])

    assert read_verdict(text) == BUILT


def test_log_lines_a_traceback_and_foreign_json_around_the_verdict_are_passed_over() -> None:
    text = "\n".join([
        "2026-01-02 03:04:05 INFO onnxruntime: loading",
        BUILT.to_json(),
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        '{"kind": "something/else", "built": false}',
        '{"level": "info", "msg": "done"}',
        "[1, 2, 3]",
        "   ",
    ])

    assert read_verdict(text) == BUILT


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(BUILT.to_json()[:-10], id="cut-short"),
        pytest.param("{" + BUILT.to_json(), id="not-json"),
        pytest.param(json.dumps({**BUILT.to_dict(), "version": "3"}), id="version-as-text"),
        pytest.param(json.dumps({**BUILT.to_dict(), "version": True}), id="version-as-bool"),
        pytest.param(json.dumps({**BUILT.to_dict(), "built": 1}), id="built-as-int"),
        pytest.param(json.dumps({**BUILT.to_dict(), "installed": 7}), id="installed-as-int"),
        pytest.param(json.dumps({k: v for k, v in BUILT.to_dict().items() if k != "reason"}),
                     id="reason-missing"),
        pytest.param(json.dumps({k: v for k, v in BUILT.to_dict().items() if k != "installed"}),
                     id="installed-missing"),
        pytest.param(json.dumps({**BUILT.to_dict(), "kind": "tiered.build/other"}),
                     id="another-kind"),
        pytest.param("[" * 100_000, id="deeply-nested"),
    ],
)
def test_a_malformed_verdict_is_ignored_in_favour_of_an_earlier_good_one(line) -> None:
    assert read_verdict(line) is None
    assert read_verdict(f"{REFUSED.to_json()}\n{line}\n") == REFUSED


@pytest.mark.parametrize("text", ["", "\n\n", "tiered build: rejected, nothing written.", "{}"])
def test_text_without_a_verdict_reads_as_none(text) -> None:
    assert read_verdict(text) is None


def test_unknown_keys_are_ignored_so_newer_builds_stay_readable() -> None:
    line = json.dumps({**BUILT.to_dict(), "seconds": 12.5})

    assert read_verdict(line) == BUILT


def test_the_reason_is_held_as_one_bounded_line() -> None:
    verdict = BuildVerdict(built=False, model="m", version=1, tier="edge",
                           reason="cannot load:\n  line one\r\n  line two " + "x" * 5000,
                           installed=None, exit_code=2)

    assert verdict.reason.startswith("cannot load: line one line two xxx")
    assert len(verdict.reason) == MAX_REASON_CHARS and verdict.reason.endswith("…")
    assert read_verdict(verdict.to_json()) == verdict
    assert len(verdict.to_json().encode()) < 4096  # what a termination message keeps
