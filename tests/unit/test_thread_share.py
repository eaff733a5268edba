"""The local system's processes share one machine's cores for their CPU thread pools."""

from __future__ import annotations

import os

from tiered.local.supervisor import thread_share


def test_each_of_the_local_systems_processes_gets_a_share_of_the_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert thread_share(3, environ={}) == {"OMP_NUM_THREADS": "5"}
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert thread_share(3, environ={}) == {"OMP_NUM_THREADS": "1"}  # never none
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one
    assert thread_share(3, environ={}) == {"OMP_NUM_THREADS": "1"}


def test_a_thread_count_the_user_set_is_kept():
    assert thread_share(3, environ={"OMP_NUM_THREADS": "8"}) == {}
