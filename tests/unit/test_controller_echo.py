"""What `tiered up` and the demo echo of the controller's log: never its
holds (the live views show them); its decisions unless the caller prints
each with its numbers; everything else, once, whole lines only."""

from __future__ import annotations

from tiered.local.supervisor import LocalSystem, LocalUp

LOG = """digits: building version 2 for edge
digits: hold: stage 1/3 'edge-canary': too short: 1 of 15 s (minDurationSeconds)
digits: advance: stage 1/3 'edge-canary' passed: on to stage 2 'region'
tinyllama: rollback: stage 2/2 'everywhere' failed
digits: edge serves versions 1, 2
digits: hold: stage 2/3"""  # the last line is not complete yet


def _echoed(tmp_path, decisions: bool) -> list[str]:
    said: list[str] = []
    up = LocalUp(LocalSystem(state_dir=str(tmp_path)), tmp_path, progress=said.append)
    up.layout.create()
    up.layout.logs.mkdir(parents=True, exist_ok=True)
    (up.layout.logs / "controller.log").write_text(LOG)
    up.echo_controller(decisions=decisions)
    up.echo_controller(decisions=decisions)  # nothing new: nothing again
    return said


def test_tiered_up_echoes_decisions_but_not_holds(tmp_path):
    assert _echoed(tmp_path, decisions=True) == [
        "digits: building version 2 for edge",
        "digits: advance: stage 1/3 'edge-canary' passed: on to stage 2 'region'",
        "tinyllama: rollback: stage 2/2 'everywhere' failed",
        "digits: edge serves versions 1, 2"]


def test_the_demo_echoes_neither_its_progress_lines_say_them(tmp_path):
    assert _echoed(tmp_path, decisions=False) == [
        "digits: building version 2 for edge", "digits: edge serves versions 1, 2"]
