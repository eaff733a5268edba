"""Leader election with client-go's semantics: never two leaders at once.

The timing rules are pure (`LeaseClock`) and table-tested. Then two real
controllers (in this process, through the real `kubernetes` client) share a
Lease on the API test double; the leader is cut off from the API server
(its Lease writes fail, its reads still answer): it stops reconciling
within its renew deadline, the standby takes the Lease only after a whole
lease duration without a change it could see, and a sampler watching both
every 10 ms never sees two leaders. Reconnected, the old leader stays a
standby while the new one renews.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("kubernetes")

from kubernetes import client  # noqa: E402

from tests.kubeapi import FakeKubeAPI  # noqa: E402
from tiered.controller.kube import render  # noqa: E402
from tiered.controller.kube.controller import ControllerOptions, KubeController  # noqa: E402
from tiered.controller.kube.lease import LeaseClock  # noqa: E402

NAMESPACE = "election"
DURATION_S = 3  # renew deadline 2 s, tries every 0.4 s


@pytest.mark.parametrize(("seen_at", "now", "expired"), [
    (10.0, 12.9, False),   # within a duration of the last change seen
    (10.0, 13.0, True),    # a whole duration without a change
])
def test_expiry_counts_from_the_last_change_this_candidate_saw(seen_at, now, expired):
    clock = LeaseClock(duration_s=3.0, renew_deadline_s=2.0, record=("a", "t1", 0),
                       seen_at=seen_at)
    assert clock.expired(now) is expired


def test_the_same_record_seen_again_does_not_restart_the_count_a_changed_one_does():
    clock = LeaseClock(duration_s=3.0, renew_deadline_s=2.0)
    clock.observe(("a", "t1", 0), 10.0)
    clock.observe(("a", "t1", 0), 12.0)  # the holder's renewTime has not moved
    assert clock.expired(13.0)
    clock.observe(("a", "t2", 0), 13.5)  # it renewed: a new term from now on
    assert not clock.expired(16.0) and clock.expired(16.5)


@pytest.mark.parametrize(("renewed_at", "now", "leading"), [
    (10.0, 11.9, True),
    (10.0, 12.0, False),  # no renewal for the renew deadline: no longer leading
    (float("-inf"), 0.0, False),
])
def test_a_leader_leads_only_within_its_renew_deadline(renewed_at, now, leading):
    clock = LeaseClock(duration_s=3.0, renew_deadline_s=2.0, renewed_at=renewed_at)
    assert clock.still_leading(now) is leading


def test_a_leader_cut_off_from_the_api_stops_before_the_standby_takes_over():
    with FakeKubeAPI() as api:
        controllers = {}
        stop = threading.Event()
        for identity in ("c1", "c2"):
            options = ControllerOptions(identity=identity, lease_duration_s=DURATION_S)
            controllers[identity] = KubeController(
                render.ClusterSettings(namespace=NAMESPACE),
                client.ApiClient(api.client_configuration()), options=options,
                progress=lambda line: None)
        timeline: list[tuple[float, frozenset[str]]] = []

        def sample() -> None:
            while not stop.is_set():
                timeline.append((time.monotonic(), frozenset(
                    name for name, c in controllers.items() if c.is_leading())))
                time.sleep(0.01)

        threads = [threading.Thread(target=c.run, args=(stop,), daemon=True)
                   for c in controllers.values()]
        threads.append(threading.Thread(target=sample, daemon=True))
        for thread in threads:
            thread.start()
        try:
            first = wait_for_leader(timeline, None)
            other = next(name for name in controllers if name != first)
            cut = time.monotonic()
            api.cut_off(first)
            second = wait_for_leader(timeline, first)
            assert second == other
            api.reconnect(first)
            time.sleep(2 * DURATION_S)  # the old leader reads a Lease that keeps changing
        finally:
            stop.set()
            for thread in threads:
                thread.join(10)

    assert all(len(leaders) <= 1 for _, leaders in timeline), "two leaders at once"
    stopped = next(t for t, leaders in timeline if t > cut and first not in leaders)
    took_over = next(t for t, leaders in timeline if second in leaders)
    # The cut-off leader stopped within its renew deadline of its last renewal
    # (which came at most one try before the cut)...
    assert stopped - cut <= DURATION_S * 2 / 3 + 0.3
    # ...and the standby waited a whole duration from the last change it saw
    # (that renewal, seen at most one try after it was written).
    assert took_over - cut >= DURATION_S - 0.5
    assert took_over > stopped
    after = [leaders for t, leaders in timeline if t > took_over + 0.1]
    assert all(leaders == {second} for leaders in after), "the old leader came back"


def test_a_late_renewal_restarts_the_term_instead_of_leaving_it_idle():
    """A renewal that comes past the renew deadline (a busy machine) ends the
    term's watch and worker while the Lease is still ours: a new term starts
    them again, rather than renewing a Lease nobody reconciles under."""
    with FakeKubeAPI() as api:
        lines: list[str] = []
        controller = KubeController(
            render.ClusterSettings(namespace=NAMESPACE), client.ApiClient(api.client_configuration()),
            options=ControllerOptions(identity="c1", lease_duration_s=DURATION_S),
            progress=lines.append)
        stop = threading.Event()
        thread = threading.Thread(target=controller.run, args=(stop,), daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while not controller.is_leading() and time.monotonic() < deadline:
                time.sleep(0.05)
            on_time = controller.elector.leading
            controller.elector.leading = lambda: False  # the renew deadline passes
            controller.queue.add("digits")  # work arrives: the worker sees the lapse, ends
            time.sleep(1.0)
            controller.elector.leading = on_time
            while lines.count("leading: reconciling TieredModels in election") < 2 \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "a renewal came late: starting the term again" in lines, lines
            assert lines.count("leading: reconciling TieredModels in election") == 2, lines
            assert controller.is_leading()
        finally:
            stop.set()
            thread.join(10)


def test_a_lease_without_a_spec_is_held_by_nobody():
    """The API allows a Lease with no spec (one made by hand): a candidate
    takes it, and a release reads it without failing."""
    from tiered.controller.kube.lease import LeaseElector

    with FakeKubeAPI() as api:
        leases = client.CoordinationV1Api(client.ApiClient(api.client_configuration()))
        leases.create_namespaced_lease(NAMESPACE, {"metadata": {"name": "by-hand"}})
        assert leases.read_namespaced_lease("by-hand", NAMESPACE).spec is None
        elector = LeaseElector(leases, NAMESPACE, "by-hand", "c1", duration_s=DURATION_S)
        assert elector.try_acquire_or_renew() and elector.leading()
        assert leases.read_namespaced_lease("by-hand", NAMESPACE).spec.holder_identity == "c1"
        elector.release()
        assert leases.read_namespaced_lease("by-hand", NAMESPACE).spec.holder_identity == ""


def wait_for_leader(timeline, not_this: str | None, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if timeline and len(timeline[-1][1]) == 1:
            (leader,) = timeline[-1][1]
            if leader != not_this:
                return leader
        time.sleep(0.02)
    raise AssertionError(f"no leader other than {not_this} within {timeout_s} s")
