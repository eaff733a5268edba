"""Lines that stay and lines that change in place: redrawn on a terminal,
printed once per change when piped."""

from __future__ import annotations

import io

from tiered.cli.live import LiveLines


def test_piped_a_live_line_is_printed_when_its_key_changes():
    out = io.StringIO()
    lines = LiveLines(out, in_place=False)
    lines.say("1. started")
    lines.live("digits", "hold: 3 of 40 requests", key="too little data")
    lines.live("digits", "hold: 9 of 40 requests", key="too little data")  # counts only
    lines.live("digits", "hold: too short", key="too short")
    lines.end("digits")
    lines.live("digits", "hold: too short", key="too short")  # a new stage shows it again
    assert out.getvalue().splitlines() == [
        "1. started", "hold: 3 of 40 requests", "hold: too short", "hold: too short"]
    assert "\033" not in out.getvalue()


def test_on_a_terminal_live_lines_are_redrawn_under_the_lines_that_stay():
    out = io.StringIO()
    lines = LiveLines(out, in_place=True)
    lines.live("digits", "digits: 3 of 40")
    lines.live("tinyllama", "tinyllama: 1 of 20")
    lines.live("digits", "digits: 9 of 40")
    lines.say("digits advance: stage 1 passed")
    lines.end("digits")
    screen = _render(out.getvalue())
    assert screen == ["digits advance: stage 1 passed", "tinyllama: 1 of 20"]


def _render(written: str) -> list[str]:
    """The screen's lines after `written`, knowing only what LiveLines sends:
    text, newlines, ESC[nF (to the start of n lines up) and ESC[J (clear below)."""
    import re

    screen: list[str] = []
    row = 0
    for part in re.split(r"(\033\[\d+F|\033\[J|\n)", written):
        if not part:
            continue
        if part == "\n":
            row += 1
        elif part == "\033[J":
            del screen[row:]
        elif part.startswith("\033["):
            row -= int(part[2:-1])
        else:
            screen[row:row + 1] = [part]
    return screen
