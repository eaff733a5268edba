"""Dynamic batching: the pure batch-formation policy, merge/split, and the
asyncio Batcher around them with a real thread pool and a fake engine."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered.agent.batching import (
    BatchDecision,
    Batcher,
    BatchPolicy,
    Pending,
    form_batch,
    merge,
    split,
)
from tiered.engines.base import concatenate_into
from tiered.errors import DeadlineExceeded, EngineError, ResourceExhausted, Unavailable

# --- form_batch: the policy ----------------------------------------------------


def _pending(batch_size: int = 1, signature: str = "s", enqueued_at: float = 0.0) -> Pending:
    # form_batch never touches the future; None stands in for it.
    return Pending({}, batch_size, signature, enqueued_at, math.inf, None)


def _policy(max_batch_size: int = 8, delay_s: float = 1.0, preferred: tuple[int, ...] = (),
            max_queue_size: int = 100, wait_when_idle: bool = False) -> BatchPolicy:
    return BatchPolicy(max_batch_size, delay_s, preferred, max_queue_size,
                       wait_when_idle=wait_when_idle)


@dataclass(frozen=True)
class FormCase:
    name: str
    queued: Sequence[Pending]
    now: float
    policy: BatchPolicy
    expected: BatchDecision
    running: int = 1  # batches running: the delay applies only while one does


FORM_CASES = [
    FormCase("empty queue waits forever",
             [], 5.0, _policy(), BatchDecision(0, math.inf)),
    FormCase("unbatched policy takes one",
             [_pending(3), _pending(1)], 0.0, _policy(max_batch_size=0), BatchDecision(1, 0.0)),
    FormCase("unbatched policy takes one even before any delay",
             [_pending()], 0.0, BatchPolicy(0, 10.0, (), 5), BatchDecision(1, 0.0)),
    FormCase("takes up to max_batch_size and stops there",
             [_pending() for _ in range(12)], 0.0, _policy(max_batch_size=8),
             BatchDecision(8, 0.0)),
    FormCase("does not go past max_batch_size with multi-row requests",
             [_pending(3), _pending(3), _pending(2), _pending(1)], 0.0, _policy(max_batch_size=8),
             BatchDecision(3, 0.0)),
    FormCase("a request that would overflow blocks: go now with what fits",
             [_pending(3), _pending(4), _pending(2)], 0.0, _policy(max_batch_size=8),
             BatchDecision(2, 0.0)),
    FormCase("an overflowing request is not skipped for a smaller one behind it",
             [_pending(6), _pending(5), _pending(1)], 0.0, _policy(max_batch_size=8),
             BatchDecision(1, 0.0)),
    FormCase("different signature at position 2: go now with the first 2",
             [_pending(signature="a"), _pending(signature="a"), _pending(signature="b"),
              _pending(signature="a")], 0.0, _policy(), BatchDecision(2, 0.0)),
    FormCase("different signature right behind the head: the head goes alone",
             [_pending(signature="a"), _pending(signature="b")], 0.0, _policy(),
             BatchDecision(1, 0.0)),
    FormCase("reaching the largest preferred size goes at once",
             [_pending() for _ in range(4)], 0.0, _policy(preferred=(2, 4)),
             BatchDecision(4, 0.0)),
    FormCase("passing the largest preferred size goes at once with all that fits",
             [_pending(3), _pending(3)], 0.0, _policy(preferred=(4,)), BatchDecision(2, 0.0)),
    FormCase("a smaller preferred size alone does not trigger",
             [_pending(), _pending()], 0.25, _policy(preferred=(2, 4)), BatchDecision(0, 0.75)),
    FormCase("preferred sizes above max_batch_size are ignored",
             [_pending() for _ in range(4)], 0.0, _policy(max_batch_size=4, preferred=(16,)),
             BatchDecision(4, 0.0)),
    FormCase("below target waits exactly the rest of the delay",
             [_pending(enqueued_at=10.0), _pending(enqueued_at=10.125)], 10.25, _policy(),
             BatchDecision(0, 0.75)),
    FormCase("the delay counts from the head, not the newest",
             [_pending(enqueued_at=1.0), _pending(enqueued_at=1.5)], 1.5, _policy(delay_s=0.75),
             BatchDecision(0, 0.25)),
    FormCase("after the delay goes with what it has",
             [_pending(enqueued_at=0.0), _pending(2, enqueued_at=0.5)], 1.0, _policy(),
             BatchDecision(2, 0.0)),
    FormCase("well after the delay still goes with what it has",
             [_pending(enqueued_at=0.0)], 100.0, _policy(), BatchDecision(1, 0.0)),
    FormCase("zero delay goes at once",
             [_pending()], 0.0, _policy(delay_s=0.0), BatchDecision(1, 0.0)),
    FormCase("an idle engine runs a lone request at once",
             [_pending()], 0.0, _policy(), BatchDecision(1, 0.0), running=0),
    FormCase("an idle engine runs all that fits at once, below every preferred size",
             [_pending(), _pending(2), _pending()], 0.0, _policy(preferred=(8,)),
             BatchDecision(3, 0.0), running=0),
    FormCase("an idle engine still stops at max_batch_size",
             [_pending() for _ in range(12)], 0.0, _policy(), BatchDecision(8, 0.0), running=0),
    FormCase("wait_when_idle waits for the delay with no batch running",
             [_pending(enqueued_at=0.0)], 0.25, _policy(wait_when_idle=True),
             BatchDecision(0, 0.75), running=0),
    FormCase("an empty queue waits forever on an idle engine too",
             [], 0.0, _policy(), BatchDecision(0, math.inf), running=0),
]


@pytest.mark.parametrize("case", FORM_CASES, ids=[c.name for c in FORM_CASES])
def test_form_batch(case: FormCase) -> None:
    assert form_batch(case.queued, case.now, case.policy, case.running) == case.expected


def test_form_batch_does_not_change_the_queue() -> None:
    queued = [_pending(2), _pending(3)]
    before = list(queued)

    form_batch(queued, 0.0, _policy(), running=1)

    assert queued == before


def test_a_head_larger_than_max_batch_size_still_makes_progress() -> None:
    decision = form_batch([_pending(9), _pending(1)], 0.0, _policy(max_batch_size=8), 1)

    assert decision.take >= 1 or decision.wait_s > 0


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8), max_size=12),
    signatures=st.lists(st.sampled_from("ab"), min_size=12, max_size=12),
    max_batch_size=st.integers(8, 16),
    preferred=st.lists(st.integers(1, 20), max_size=3),
    waited=st.floats(0.0, 2.0),
    running=st.integers(0, 2),
)
def test_form_batch_takes_a_same_signature_prefix_within_max_batch_size(
    sizes, signatures, max_batch_size, preferred, waited, running
) -> None:
    queued = [_pending(size, sig) for size, sig in zip(sizes, signatures)]
    policy = _policy(max_batch_size=max_batch_size, delay_s=1.0, preferred=tuple(preferred))

    decision = form_batch(queued, waited, policy, running)

    if not queued:
        assert decision == BatchDecision(0, math.inf)
        return
    assert decision.take >= 1 or decision.wait_s > 0  # always progress
    assert decision.take >= 1 or running > 0  # an idle engine never waits
    taken = queued[:decision.take]
    assert sum(p.batch_size for p in taken) <= max_batch_size
    assert {p.signature for p in taken} <= {queued[0].signature}
    if decision.take:
        assert decision.wait_s == 0.0
    else:
        assert decision.wait_s == pytest.approx(1.0 - waited)


@pytest.mark.parametrize(
    ("max_batch_size", "preferred", "target"),
    [(8, (), 8), (8, (2, 6, 4), 6), (8, (16,), 8), (8, (8, 16), 8), (0, (), 0)],
)
def test_target_size_is_the_largest_usable_preferred_size_else_the_max(
    max_batch_size, preferred, target
) -> None:
    assert _policy(max_batch_size=max_batch_size, preferred=preferred).target_size == target


# --- merge / split ---------------------------------------------------------------


def _bytes_rows(rows: int, tag: str) -> np.ndarray:
    array = np.empty((rows, 2), dtype=object)
    for i in range(rows):
        array[i] = [f"{tag}{i}".encode(), b""]
    return array


MERGE_DTYPES = [np.float32, np.float16, np.int64, np.uint8, np.bool_]


@pytest.mark.parametrize("sizes", [[1, 1], [3], [1, 2, 5], [4, 4, 4, 4], [2, 7]],
                         ids=lambda s: "+".join(map(str, s)))
@pytest.mark.parametrize("dtype", MERGE_DTYPES, ids=lambda d: np.dtype(d).name)
def test_merge_concatenates_and_split_returns_each_request(sizes, dtype) -> None:
    rng = np.random.default_rng(sum(sizes))
    requests = [
        {"x": (rng.standard_normal((n, 3)) * 10).astype(dtype), "t": _bytes_rows(n, f"r{k}-")}
        for k, n in enumerate(sizes)
    ]

    merged = merge(requests)
    parts = split(merged, sizes)

    assert merged["x"].shape == (sum(sizes), 3)
    assert merged["x"].dtype == np.dtype(dtype)
    assert merged["t"].dtype == object and merged["t"].shape == (sum(sizes), 2)
    np.testing.assert_array_equal(merged["x"], np.concatenate([r["x"] for r in requests]))
    assert len(parts) == len(sizes)
    for request, part in zip(requests, parts):
        assert part.keys() == request.keys()
        np.testing.assert_array_equal(part["x"], request["x"])
        np.testing.assert_array_equal(part["t"], request["t"])


def test_merge_takes_read_only_and_strided_parts_as_numpy_would() -> None:
    rows = np.arange(24, dtype=np.float32).reshape(4, 6)
    read_only = np.frombuffer(rows[:2].tobytes(), np.float32).reshape(2, 6)  # an arena's view
    strided = rows[:, ::2].copy()[:, None, :].repeat(2, axis=1)[:, 0, :]  # not contiguous
    requests = [{"x": read_only}, {"x": rows[2:]}]
    np.testing.assert_array_equal(merge(requests)["x"], rows)
    assert not strided.flags.c_contiguous
    mixed = merge([{"x": strided[:1]}, {"x": strided[1:]}])["x"]
    np.testing.assert_array_equal(mixed, strided)
    with pytest.raises(ValueError):  # parts that do not fill the batch are refused
        concatenate_into([rows[:1]], np.empty((2, 6), np.float32))


def test_split_cuts_outputs_of_other_shapes_by_rows() -> None:
    outputs = {"logits": np.arange(12.0).reshape(6, 2), "label": np.arange(6)}

    parts = split(outputs, [1, 2, 3])

    assert [p["label"].tolist() for p in parts] == [[0], [1, 2], [3, 4, 5]]
    assert [p["logits"].shape for p in parts] == [(1, 2), (2, 2), (3, 2)]


def test_merge_of_a_single_request_returns_its_arrays() -> None:
    x = np.ones((2, 3), np.float32)

    merged = merge([{"x": x}])

    assert merged == {"x": x} and merged["x"] is x


def test_split_of_a_single_request_returns_the_outputs_unchanged() -> None:
    y = np.arange(5)  # even a leading dim that does not match the request is passed through
    scalar = np.float32(3.0)

    (part,) = split({"y": y, "s": scalar}, [2])

    assert part["y"] is y and part["s"] is scalar


@pytest.mark.parametrize(
    ("outputs", "sizes"),
    [
        ({"y": np.zeros((4, 2))}, [2, 3]),
        ({"y": np.zeros((6, 2))}, [2, 3]),
        ({"y": np.zeros((5,)), "z": np.zeros((3, 5))}, [2, 3]),
        ({"y": np.float32(1.0)}, [1, 1]),
    ],
    ids=["too short", "too long", "one of two outputs wrong", "scalar output"],
)
def test_split_refuses_outputs_without_the_batch_dimension(outputs, sizes) -> None:
    with pytest.raises(EngineError, match="needs it to lead with the batch dimension"):
        split(outputs, sizes)


# --- Batcher: the asyncio loop --------------------------------------------------


class FakeEngine:
    """Records each batch it runs; doubles `x` into `y` (thread-safe)."""

    def __init__(self, sleep_s: float = 0.0, fail_first: int = 0) -> None:
        self.sleep_s = sleep_s
        self.fail_first = fail_first
        self.batches: list[list[float]] = []  # the `x[:, 0]` values of each batch
        self.started = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self._lock = threading.Lock()
        self._active = 0
        self.peak_concurrency = 0

    @property
    def sizes(self) -> list[int]:
        return [len(b) for b in self.batches]

    def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            self.batches.append(inputs["x"][:, 0].tolist())
            failing = len(self.batches) <= self.fail_first
            self._active += 1
            self.peak_concurrency = max(self.peak_concurrency, self._active)
        self.started.set()
        self.release.wait(5.0)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        with self._lock:
            self._active -= 1
        if failing:
            raise EngineError("engine exploded: out of unicorns")
        return {"y": inputs["x"] * 2}


def _run(scenario: Callable[[ThreadPoolExecutor], object], workers: int = 2):
    with ThreadPoolExecutor(workers) as executor:
        return asyncio.run(asyncio.wait_for(scenario(executor), 10.0))


def _x(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 2), value, np.float32)}


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.001)


def test_concurrent_requests_are_merged_and_each_caller_gets_its_own_slice() -> None:
    engine = FakeEngine(sleep_s=0.01)

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(8, 0.002, (), 64, instances=1), engine, executor)
        results = await asyncio.gather(*(
            batcher.submit(_x(i, rows=1 + i % 2), 1 + i % 2, "sig") for i in range(32)
        ))
        await batcher.close()
        return results

    results = _run(scenario)

    assert max(engine.sizes) > 1
    assert all(size <= 8 for size in engine.sizes)
    assert sum(engine.sizes) == sum(1 + i % 2 for i in range(32))
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.outputs["y"], np.full((1 + i % 2, 2), 2.0 * i))
        assert result.batch_size <= 8
        assert result.queue_s >= 0


def test_batches_respect_signatures() -> None:
    engine = FakeEngine()

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(8, 0.05, (), 64), engine, executor)
        engine.release.clear()  # hold the engine while the queue fills
        first = asyncio.ensure_future(batcher.submit(_x(-1), 1, "a"))
        await _until(engine.started.is_set)
        rest = [asyncio.ensure_future(batcher.submit(_x(i), 1, "aabb"[i])) for i in range(4)]
        await asyncio.sleep(0)
        engine.release.set()
        await asyncio.gather(first, *rest)
        await batcher.close()

    _run(scenario)

    assert engine.batches == [[-1.0], [0.0, 1.0], [2.0, 3.0]]


@pytest.mark.parametrize("wait_when_idle", [False, True])
def test_an_idle_engine_runs_a_lone_request_at_once_unless_told_to_wait(wait_when_idle) -> None:
    engine = FakeEngine()
    delay_s = 0.5

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(8, delay_s, (), 64, wait_when_idle=wait_when_idle),
                          engine, executor)
        started = time.monotonic()
        await batcher.submit(_x(1), 1, "s")
        took = time.monotonic() - started
        await batcher.close()
        return took

    took = _run(scenario)

    if wait_when_idle:
        assert took >= delay_s * 0.9  # asyncio's timer may fire a little early
    else:
        assert took < delay_s / 2  # one thread hop, with room for a busy machine


def test_requests_arriving_while_the_engine_is_busy_form_the_next_batch() -> None:
    engine = FakeEngine()

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(8, 10.0, (), 64, instances=2), engine, executor)
        engine.release.clear()  # hold the first batch while the others arrive
        first = asyncio.ensure_future(batcher.submit(_x(-1), 1, "s"))
        await _until(engine.started.is_set)
        # A second instance is free, but one batch runs: it waits for more
        # (up to the delay) and goes as soon as the running batch ends.
        rest = [asyncio.ensure_future(batcher.submit(_x(i), 1, "s")) for i in range(3)]
        await asyncio.sleep(0.05)
        assert engine.batches == [[-1.0]]
        engine.release.set()
        await asyncio.gather(first, *rest)
        await batcher.close()

    _run(scenario)

    assert engine.batches == [[-1.0], [0.0, 1.0, 2.0]]


def test_on_batch_reports_each_executed_batch_size() -> None:
    engine = FakeEngine()
    seen: list[int] = []

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(8, 0.01, (3,), 64), engine, executor,
                          on_batch=lambda size, timing: seen.append(size))
        await asyncio.gather(*(batcher.submit(_x(i), 1, "s") for i in range(3)))
        await batcher.close()

    _run(scenario)

    assert seen == engine.sizes == [3]


def test_a_full_queue_refuses_at_once() -> None:
    engine = FakeEngine()

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(0, 0.0, (), max_queue_size=2), engine, executor)
        engine.release.clear()
        running = asyncio.ensure_future(batcher.submit(_x(0), 1, "s"))
        await _until(engine.started.is_set)  # the first request left the queue
        queued = [asyncio.ensure_future(batcher.submit(_x(i), 1, "s")) for i in (1, 2)]
        await asyncio.sleep(0)
        assert batcher.queue_depth == 2
        started = time.monotonic()
        with pytest.raises(ResourceExhausted, match="queue full.*max_queue_size 2"):
            await batcher.submit(_x(3), 1, "s")
        refused_after = time.monotonic() - started
        engine.release.set()
        await asyncio.gather(running, *queued)
        await batcher.close()
        return refused_after

    assert _run(scenario) < 0.05
    assert engine.batches == [[0.0], [1.0], [2.0]]


def test_an_engine_error_fails_every_request_of_its_batch_and_the_next_batch_succeeds() -> None:
    engine = FakeEngine(fail_first=1)

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(8, 0.01, (3,), 64), engine, executor)
        failed = await asyncio.gather(
            *(batcher.submit(_x(i), 1, "s") for i in range(3)), return_exceptions=True
        )
        ok = await batcher.submit(_x(7), 1, "s")
        await batcher.close()
        return failed, ok

    failed, ok = _run(scenario)

    assert engine.sizes == [3, 1]
    assert all(isinstance(error, EngineError) for error in failed)
    assert {str(error) for error in failed} == {"engine exploded: out of unicorns"}
    np.testing.assert_array_equal(ok.outputs["y"], np.full((1, 2), 14.0))


def test_an_unexpected_engine_exception_becomes_an_engine_error() -> None:
    def broken(inputs):
        raise ZeroDivisionError("division by zero")

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(0, 0.0, (), 4), broken, executor)
        try:
            with pytest.raises(EngineError, match="engine failed: division by zero"):
                await batcher.submit(_x(1), 1, "s")
        finally:
            await batcher.close()

    _run(scenario)


def test_outputs_without_a_batch_dimension_fail_the_batch_with_an_engine_error() -> None:
    def scalar(inputs):
        return {"y": np.float32(inputs["x"].sum())}

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(8, 0.01, (2,), 4), scalar, executor)
        results = await asyncio.gather(
            batcher.submit(_x(1), 1, "s"), batcher.submit(_x(2), 1, "s"), return_exceptions=True
        )
        await batcher.close()
        return results

    results = _run(scenario)

    assert all(isinstance(r, EngineError) and "'y'" in str(r) for r in results)


def test_a_request_whose_deadline_passes_in_the_queue_is_never_run() -> None:
    engine = FakeEngine()

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(0, 0.0, (), 8), engine, executor)
        engine.release.clear()
        running = asyncio.ensure_future(batcher.submit(_x(0), 1, "s"))
        await _until(engine.started.is_set)
        late = asyncio.ensure_future(
            batcher.submit(_x(1), 1, "s", deadline=time.monotonic() + 0.01)
        )
        await asyncio.sleep(0.03)  # its deadline passes while the engine is busy
        engine.release.set()
        await running
        with pytest.raises(DeadlineExceeded, match="in the queue"):
            await late
        after = await batcher.submit(_x(2), 1, "s")
        await batcher.close()
        return after

    after = _run(scenario)

    assert engine.batches == [[0.0], [2.0]]
    np.testing.assert_array_equal(after.outputs["y"], np.full((1, 2), 4.0))


def test_a_cancelled_callers_request_is_skipped() -> None:
    engine = FakeEngine()

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(0, 0.0, (), 8), engine, executor)
        engine.release.clear()
        running = asyncio.ensure_future(batcher.submit(_x(0), 1, "s"))
        await _until(engine.started.is_set)
        abandoned = asyncio.ensure_future(batcher.submit(_x(1), 1, "s"))
        kept = asyncio.ensure_future(batcher.submit(_x(2), 1, "s"))
        await asyncio.sleep(0)
        abandoned.cancel()
        await asyncio.sleep(0)
        engine.release.set()
        await asyncio.gather(running, kept)
        await batcher.close()
        return abandoned

    abandoned = _run(scenario)

    assert abandoned.cancelled()
    assert engine.batches == [[0.0], [2.0]]


def test_close_finishes_queued_requests_then_refuses_new_ones() -> None:
    engine = FakeEngine(sleep_s=0.005)

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(2, 0.01, (), 16), engine, executor)
        queued = [asyncio.ensure_future(batcher.submit(_x(i), 1, "s")) for i in range(5)]
        await asyncio.sleep(0)  # let them enqueue
        await batcher.close()
        assert engine.sizes and sum(engine.sizes) == 5  # all ran before close returned
        with pytest.raises(Unavailable, match="unloading"):
            await batcher.submit(_x(9), 1, "s")
        return await asyncio.gather(*queued)

    results = _run(scenario)

    assert sorted(v for batch in engine.batches for v in batch) == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert all(size <= 2 for size in engine.sizes)
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.outputs["y"], np.full((1, 2), 2.0 * i))


def test_close_of_an_idle_batcher_returns_at_once() -> None:
    async def scenario(executor):
        batcher = Batcher(BatchPolicy(4, 10.0, (), 4), FakeEngine(), executor)
        started = time.monotonic()
        await batcher.close()
        return time.monotonic() - started

    assert _run(scenario) < 0.5


@pytest.mark.parametrize("instances", [1, 2, 3])
def test_at_most_instances_batches_run_at_once(instances: int) -> None:
    engine = FakeEngine(sleep_s=0.03)

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(0, 0.0, (), 8, instances=instances), engine, executor)
        await asyncio.gather(*(batcher.submit(_x(i), 1, "s") for i in range(6)))
        await batcher.close()

    _run(scenario, workers=4)

    assert engine.sizes == [1] * 6
    assert engine.peak_concurrency == instances


def _thread_of_each_batch(engine_s: float) -> list[str]:
    threads: list[str] = []

    def engine(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        threads.append(threading.current_thread().name)
        if engine_s:
            time.sleep(engine_s)
        return {"y": inputs["x"]}

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(0, 0.0, (), 8), engine, executor)
        for i in range(5):
            await batcher.submit(_x(i), 1, "sig")
        await batcher.close()

    _run(scenario)
    return threads


def test_batches_faster_than_a_thread_hop_run_on_the_event_loop() -> None:
    threads = _thread_of_each_batch(engine_s=0.0)
    assert threads[0] != threading.main_thread().name  # unknown speed: a worker first
    assert threads[1:] == [threading.main_thread().name] * 4


def test_slow_batches_stay_on_worker_threads() -> None:
    threads = _thread_of_each_batch(engine_s=0.002)
    assert threading.main_thread().name not in threads


def test_load_counts_the_batch_elements_queued_and_running() -> None:
    engine = FakeEngine(sleep_s=0.1)
    seen = []

    async def scenario(executor):
        batcher = Batcher(BatchPolicy(0, 0.0, (), 8, instances=1), engine, executor)
        assert batcher.load == 0
        sizes = (2, 3, 1)
        tasks = [asyncio.ensure_future(batcher.submit(_x(0, rows=n), n, "s")) for n in sizes]
        await asyncio.sleep(0.05)  # the first runs, the others wait
        seen.append(batcher.load)
        await tasks[0]
        await asyncio.sleep(0.05)
        seen.append(batcher.load)
        await asyncio.gather(*tasks)
        seen.append(batcher.load)
        await batcher.close()

    _run(scenario)
    assert seen == [6, 4, 0]
