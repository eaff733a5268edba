"""The feed from front ends to the engine: the arena's blocks never overlap
while live and space comes back; plain requests are checked in the front end
and merged into one frame, and each gets its own rows back."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import grpc
import numpy as np
import pytest
import tritonclient.utils.shared_memory as shm
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered.agent.feed import (
    Arena,
    FedError,
    FeedClient,
    FeedServer,
    ModelFacts,
    OutputInRegion,
    OutputOnDevice,
    _cut,
    _Group,
)
from tiered.agent.front_end import front_end_count
from tiered.agent.scheduler import Piece
from tiered.agent.shared_memory import CudaRange, RegionViews, not_registered, open_view
from tiered.errors import Unavailable
from tiered.protocol import codec
from tiered.protocol import grpc_service_pb2 as pb
from tiered.protocol import model_config_pb2 as mc

SIZE = 1000


def overlapping(blocks) -> bool:
    spans = sorted((b.start, b.end) for b in blocks)
    return any(end > start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_a_full_ring_after_wrapping_refuses_instead_of_overlapping():
    arena = Arena(SIZE)
    first, second = arena.allocate(500), arena.allocate(500)
    arena.free(first)
    third = arena.allocate(500)  # wraps to the start, before `second`
    assert third.start == 0
    assert arena.allocate(1) is None  # [0, 1000) is all live again
    arena.free(second)
    assert arena.allocate(500).start == 500
    arena.close()


def test_a_block_freed_out_of_order_comes_back_with_the_oldest():
    arena = Arena(SIZE)
    a, b = arena.allocate(400), arena.allocate(400)
    arena.free(b)
    assert arena.allocate(400) is None  # `a` still holds the ring's tail
    arena.free(a)
    assert arena.allocate(SIZE) is not None  # all of it is free again
    arena.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 600)), max_size=60))
def test_live_blocks_never_overlap_and_all_space_returns(operations):
    arena = Arena(SIZE)
    live = []
    for allocate, size in operations:
        if allocate or not live:
            block = arena.allocate(size)
            if block is not None:
                assert 0 <= block.start < block.end <= SIZE and block.end - block.start == size
                live.append(block)
        else:
            arena.free(live.pop(size % len(live)))
        assert not overlapping(live)
    for block in live:
        arena.free(block)
    assert arena.allocate(SIZE) is not None
    arena.close()


def test_the_profiles_front_ends_are_capped_by_the_cores():
    assert front_end_count(8, cores=16) == 8
    assert front_end_count(8, cores=6) == 3  # half the cores: the engine needs the rest
    assert front_end_count(8, cores=2) == 0  # too few cores: one process serves
    assert front_end_count(0, cores=64) == 0  # one process, as asked
    cores = len(os.sched_getaffinity(0))
    assert front_end_count(8) == front_end_count(8, cores)


# -- plain requests: checked in the front end, merged into one frame -------------------

def config(max_batch_size: int = 8, batching: bool = True) -> mc.ModelConfig:
    message = mc.ModelConfig(name="m", max_batch_size=max_batch_size)
    message.input.add(name="x", data_type=mc.TYPE_FP32, dims=[-1, 3])
    message.input.add(name="n", data_type=mc.TYPE_INT64, dims=[1])
    message.output.add(name="y", data_type=mc.TYPE_FP32, dims=[-1, 3])
    message.output.add(name="s", data_type=mc.TYPE_FP32, dims=[1])
    if batching:
        message.dynamic_batching.max_queue_delay_microseconds = 100
    return message


def request(rows: int = 1, width: int = 2, x_type: str = "FP32", outputs=("y",)):
    message = pb.ModelInferRequest(model_name="m", id=f"r{rows}x{width}")
    x = (np.arange(rows * width * 3, dtype=np.float32) + 100 * rows).reshape(rows, width, 3)
    message.inputs.add(name="x", datatype=x_type, shape=[rows, width, 3])
    message.inputs.add(name="n", datatype="INT64", shape=[rows, 1])
    message.raw_input_contents.extend([x.tobytes(), np.full((rows, 1), rows, np.int64).tobytes()])
    for name in outputs:
        message.outputs.add(name=name)
    return message


def group_key(facts: ModelFacts, message):
    return facts.group_key(message, list(message.raw_input_contents))


def test_a_front_end_keeps_as_many_frames_in_the_engine_as_it_runs_batches_at_once():
    assert ModelFacts.of(config()).frames_ahead == 2  # one instance: still two, pipelined
    message = config()
    message.instance_group.add(count=2)
    message.parameters["devices"].string_value = "cuda:0,cuda:1,cuda:2"
    assert ModelFacts.of(message).frames_ahead == 6


def test_a_plain_request_is_keyed_by_model_inputs_and_outputs_with_its_rows():
    facts = ModelFacts.of(config())
    key, rows = group_key(facts, request(rows=3))
    assert rows == 3
    assert key == ("m", "", (("x", "FP32", (2, 3)), ("n", "INT64", (1,))), ("y",), None)
    assert group_key(facts, request(width=5))[0] != key  # another width: another batch
    assert group_key(facts, request(outputs=()))[0] != key


def test_a_request_the_engine_must_judge_travels_alone():
    facts = ModelFacts.of(config())
    odd = [request(x_type="FP16"), request(rows=9), request(outputs=("nope",))]
    with_parameter = request()
    with_parameter.parameters["priority"].int64_param = 1
    bad_shape = request()
    bad_shape.inputs[1].shape[:] = [1, 2]  # the bytes say [1, 1]
    short = request()
    short.raw_input_contents[0] = b"\0" * 4
    in_region = request()
    in_region.inputs[0].parameters["shared_memory_region"].string_param = "r"
    for message in (*odd, with_parameter, bad_shape, short, in_region):
        assert group_key(facts, message) is None
    assert group_key(ModelFacts.of(config(batching=False)), request()) is None
    assert group_key(ModelFacts.of(config(max_batch_size=0)), request()) is None
    assert group_key(ModelFacts(), request()) is None  # a model the front end cannot describe


def test_what_a_front_end_answers_for_itself_does_not_keep_a_request_alone():
    """perf_analyzer flags every request for an empty final response (only a
    decoupled model reads it), and outputs the front end writes into shared
    memory itself keep their region parameters: such requests still merge."""
    facts = ModelFacts.of(config())
    flagged = request()
    flagged.parameters["triton_enable_empty_final_response"].bool_param = True
    assert group_key(facts, flagged) == group_key(facts, request())
    in_region = request()
    in_region.outputs[0].parameters["shared_memory_region"].string_param = "r"
    assert group_key(facts, in_region) is None  # the engine writes it
    by_front_end = {"y": OutputInRegion(RegionViews(), "", {})}
    assert facts.group_key(in_region, list(in_region.raw_input_contents), by_front_end) == \
        group_key(facts, request())
    by_engine = {"y": OutputOnDevice({})}  # a CUDA region: one caller's frame
    assert facts.group_key(in_region, list(in_region.raw_input_contents), by_engine, "c")[0] \
        == (*group_key(facts, request())[0][:4], "c")


def test_each_request_of_a_frame_gets_its_outputs_in_its_own_region_or_its_own_error():
    """The front end writes each request's rows into the range it named; a
    region unregistered while the frame ran fails that request alone."""
    views, size = RegionViews(), 2 * 3 * 4
    key = f"/tiered-test-feed-{os.getpid()}"
    handle = shm.create_shared_memory_region("out", key, size)
    try:
        views.keep("", open_view("out", key, 0, size), views.generation)
        kept = {"shared_memory_region": "out", "shared_memory_byte_size": size}
        gone = {**kept, "shared_memory_region": "gone"}
        loop = asyncio.new_event_loop()
        group = _Group(("m", "", (), ("y",)), requests=[request(), request()], rows=[1, 1],
                       placed=[{"y": OutputInRegion(views, "", kept)},
                               {"y": OutputInRegion(views, "", gone)}],
                       futures=[loop.create_future(), loop.create_future()])
        loop.close()
        y = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)
        (first, answer), (second, error) = _cut(
            group, ("m", "7", [("y", "FP32", [2, 2, 3])], {}), y.tobytes())
        assert (first, second) == (0, grpc.StatusCode.INVALID_ARGUMENT.value[0])
        response = pb.ModelInferResponse.FromString(answer)
        assert response.raw_output_contents == [b""]  # in the region, not on the wire
        assert response.outputs[0].parameters["shared_memory_region"].string_param == "out"
        np.testing.assert_array_equal(
            shm.get_contents_as_numpy(handle, np.float32, [1, 2, 3]), y[:1])
        assert b"no shared-memory region 'gone' is registered" in error
    finally:
        views.close()
        shm.destroy_shared_memory_region(handle)


class Doubling:
    """The engine's answers: y = 2x over the merged rows, every frame
    recorded; frames wait for `go` to be answered."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.ones = 0
        self.go = asyncio.Event()

    async def answer_one(self, body, raw, seconds_left):
        self.ones += 1
        return b"alone"

    async def answer_group(self, model, version, inputs, outputs, rows, seconds_left):
        self.groups.append(list(rows))
        assert inputs["n"].ravel().tolist() == [r for r in rows for _ in range(r)]
        await self.go.wait()
        return model, "7", {"y": 2 * inputs["x"]}


async def frames_reach(engine: Doubling, count: int) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while len(engine.groups) < count and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.005)


def test_requests_gather_while_frames_of_their_kind_are_in_the_engine(tmp_path):
    engine = Doubling()
    rows = (1, 3, 2, 2, 1, 3, 1)

    async def main():
        server = FeedServer(str(tmp_path / "feed.sock"), engine, 1 << 20)
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        facts = ModelFacts.of(config())
        messages = [request(r) for r in rows]
        sent = [list(m.raw_input_contents)[0] for m in messages]
        calls = []
        for message in messages:  # one at a time, so the order is known
            calls.append(asyncio.ensure_future(client.infer(message, 5.0, facts)))
            await asyncio.sleep(0)  # it is sent, or gathered
        alone = asyncio.ensure_future(client.infer(request(x_type="FP16"), 5.0, facts))
        await frames_reach(engine, 3)
        await asyncio.sleep(0.05)  # a fourth frame, if one were sent too early
        frames_while_busy = [list(g) for g in engine.groups]
        engine.go.set()
        answers = await asyncio.gather(*calls, alone)
        await server.close()
        arena.close()
        return frames_while_busy, sent, answers

    frames_while_busy, sent, answers = asyncio.run(main())
    # Two frames at once (MIN_FRAMES_AHEAD); the rest gathered up to the model's
    # 8 rows, which then went at once; the last one went once a frame was answered.
    assert frames_while_busy == [[1], [3], [2, 2, 1, 3]]
    assert engine.groups == [[1], [3], [2, 2, 1, 3], [1]] and engine.ones == 1
    assert answers[-1] == b"alone"
    for count, raw, answer in zip(rows, sent, answers):
        response = pb.ModelInferResponse.FromString(answer)
        assert (response.model_name, response.model_version, response.id) == \
            ("m", "7", f"r{count}x2")
        (output,) = response.outputs
        assert (output.name, output.datatype, list(output.shape)) == ("y", "FP32", [count, 2, 3])
        np.testing.assert_array_equal(
            np.frombuffer(response.raw_output_contents[0], np.float32),
            2 * np.frombuffer(raw, np.float32))


def test_an_engine_error_reaches_every_request_of_the_frame(tmp_path):
    class Failing(Doubling):
        async def answer_group(self, *args):
            raise Unavailable("the queue is full")

    async def main():
        server = FeedServer(str(tmp_path / "feed.sock"), Failing(), 1 << 20)
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        facts = ModelFacts.of(config())
        outcomes = await asyncio.gather(*(client.infer(request(), 5.0, facts)
                                          for _ in range(5)), return_exceptions=True)
        assert arena.allocate(1 << 16) is not None  # the frame's block came back
        await server.close()
        arena.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert all(isinstance(o, FedError) and o.code == grpc.StatusCode.UNAVAILABLE.value[0]
               and "queue is full" in str(o) for o in outcomes), outcomes


class RegionsOfOneCaller:
    """A caller's regions as the engine reads and writes them (`CallerRegions`),
    in host bytes here; "gone" was unregistered."""

    def __init__(self, memory: dict[str, bytearray]) -> None:
        self.memory = memory

    def read(self, parameters, datatype, shape, field):
        start = parameters["shared_memory_offset"]
        data = self.memory[parameters["shared_memory_region"]]
        return np.frombuffer(bytes(data[start:start + parameters["shared_memory_byte_size"]]),
                             codec.DATATYPES[datatype]).reshape(shape)

    def write_rows(self, wanted, rows, outputs):
        failed, row = {}, 0
        for index, (names, count) in enumerate(zip(wanted, rows)):
            for name, parameters in names.items():
                region = parameters["shared_memory_region"]
                if region not in self.memory:
                    failed[index] = not_registered(f"output {name!r}", region)
                    continue
                raw, start = outputs[name][row:row + count].tobytes(), \
                    parameters["shared_memory_offset"]
                self.memory[region][start:start + len(raw)] = raw
            row += count
        return failed


def test_requests_in_cuda_regions_merge_as_ranges_the_engine_reads_and_writes(tmp_path):
    """Inputs in CUDA regions travel as ranges (the engine alone maps the
    regions) and merge into one frame of one caller's requests; outputs
    asked for in CUDA regions are written by the engine, and one whose region
    went meanwhile fails its request alone."""
    rows = (1, 3, 2)
    messages = [request(r) for r in rows]
    memory = {"x": bytearray(), "n": bytearray(), "out": bytearray(6 * 4 * sum(rows))}
    buffers, placed, at = [], [], 0
    for message, count in zip(messages, rows):
        ranges = []
        for name, raw in zip(("x", "n"), message.raw_input_contents):
            ranges.append(CudaRange(name, len(memory[name]), len(raw)))
            memory[name] += raw
        buffers.append(ranges)
        region = "gone" if count == 3 else "out"
        parameters = {"shared_memory_region": region, "shared_memory_offset": at,
                      "shared_memory_byte_size": 6 * 4 * count}
        message.outputs[0].parameters["shared_memory_region"].string_param = region
        placed.append({"y": OutputOnDevice(parameters)})
        at += 6 * 4 * count

    class OnDevice(Doubling):
        def regions(self, caller):
            assert caller == "c"
            return RegionsOfOneCaller(memory)

    engine = OnDevice()
    engine.go.set()
    sent = [bytes(m.raw_input_contents[0]) for m in messages]

    async def main():
        server = FeedServer(str(tmp_path / "feed.sock"), engine, 1 << 20)
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        facts = replace(ModelFacts.of(config()), frames_ahead=1)
        calls = [asyncio.ensure_future(client.infer(m, 5.0, facts, b, p, "c"))
                 for m, b, p in zip(messages, buffers, placed)]
        answers = await asyncio.gather(*calls, return_exceptions=True)
        await server.close()
        arena.close()
        return answers

    answers = asyncio.run(main())
    assert engine.groups == [[1], [3, 2]]  # the last two gathered while the first ran
    assert isinstance(answers[1], FedError) and \
        "no shared-memory region 'gone' is registered" in str(answers[1])
    for index in (0, 2):
        response = pb.ModelInferResponse.FromString(answers[index])
        assert response.raw_output_contents == [b""]  # in the region, not on the wire
        assert response.outputs[0].parameters["shared_memory_region"].string_param == "out"
        start = placed[index]["y"].parameters["shared_memory_offset"]
        written = bytes(memory["out"][start:start + 6 * 4 * rows[index]])
        np.testing.assert_array_equal(np.frombuffer(written, np.float32),
                                      2 * np.frombuffer(sent[index], np.float32))


WORDS = 64  # the test tokenizer's: token t is "w{t}"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A real tokenizer.json whose token t decodes to "w{t}", words spaced."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{t}": t for t in range(WORDS)},
                                           unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


class Counting:
    """A generative engine's side of STREAM frames: `tokens` token ids, one
    a loop turn (the first alone, the rest once `more` is set), an error
    after `fail_after` of them where set; records each stream's end (done,
    cancelled, or finished by its stop string)."""

    def __init__(self, tokenizer_dir, tokens: int, fail_after: int | None = None,
                 stops: tuple[str, ...] = ()) -> None:
        self.head = (3, 4, "torch-generative", str(tokenizer_dir), stops)
        self.tokens, self.fail_after = tokens, fail_after
        self.ended: list[str] = []
        self.more = asyncio.Event()
        self.sent = asyncio.Event()  # every token has been sent

    def start_generation(self, body, seconds_left, deliver):
        pb.ModelInferRequest.FromString(body)
        task = asyncio.get_running_loop().create_task(self._run(deliver))

        def stop(done: bool = False) -> None:
            self.ended.append("finished" if done else "cancelled")
            task.cancel()
        return self.head, stop

    async def _run(self, deliver) -> None:
        await asyncio.sleep(0)  # never before the head
        for token in range(self.tokens):
            if token == self.fail_after:
                deliver(Unavailable("the engine core exited"))
                return
            last = token == self.tokens - 1
            deliver(Piece("", token % WORDS, last, 0.0, prompt_tokens=5,
                          finish="length" if last else ""))
            if token == 0:
                await self.more.wait()
            await asyncio.sleep(0)
        self.sent.set()
        self.ended.append("done")


def test_a_stream_comes_as_text_made_here_merged_while_unread_and_its_error_ends_it(
        tmp_path, tokenizer_dir):
    async def main():
        engine = Counting(tokenizer_dir, tokens=10)
        server = FeedServer(str(tmp_path / "feed.sock"), engine, 1 << 20)
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        stream = client.generate(pb.ModelInferRequest(model_name="m", id="s"), 5.0)
        first = await anext(stream)
        engine.more.set()
        await engine.sent.wait()  # the other nine arrive while nobody reads
        await asyncio.sleep(0.05)
        rest = [chunk async for chunk in stream]
        failing = Counting(tokenizer_dir, tokens=10, fail_after=2)
        failing.more.set()
        server.answers = failing
        got = []
        try:
            async for chunk in client.generate(pb.ModelInferRequest(id="f"), 5.0):
                got.append(chunk[1])
        except FedError as error:
            failed = error
        await server.close()
        arena.close()
        return first, rest, engine.ended, got, failed

    first, rest, ended, got, failed = asyncio.run(main())
    assert first == (3, "w0", [0], 5, "", False)
    # Up to 4 tokens a chunk once merged (the most a response carries), in order.
    assert [chunk[2] for chunk in rest] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert "".join(chunk[1] for chunk in rest) == "".join(f" w{t}" for t in range(1, 10))
    assert [chunk[4:6] for chunk in rest] == [("", False), ("", False), ("length", True)]
    assert ended == ["done"]
    assert "".join(got) == "w0 w1"  # what came before the error is not lost
    assert failed.code == grpc.StatusCode.UNAVAILABLE.value[0] and "core exited" in str(failed)


def test_a_stop_string_ends_the_text_here_and_the_request_there_as_done(
        tmp_path, tokenizer_dir):
    async def main():
        engine = Counting(tokenizer_dir, tokens=1 << 30, stops=(" w4",))  # runs until ended
        engine.more.set()
        server = FeedServer(str(tmp_path / "feed.sock"), engine, 1 << 20)
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        chunks = [chunk async for chunk in client.generate(pb.ModelInferRequest(id="s"), 5.0)]
        deadline = asyncio.get_running_loop().time() + 10
        while not engine.ended and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        await server.close()
        arena.close()
        return chunks, engine.ended

    chunks, ended = asyncio.run(main())
    assert "".join(chunk[1] for chunk in chunks) == "w0 w1 w2 w3"
    assert chunks[-1][4:6] == ("stop", True)
    assert [len(chunk[2]) for chunk in chunks] <= [4] * len(chunks)
    assert ended == ["finished"]  # a FINISH frame, not a CANCEL


def test_a_tokenizer_the_front_end_cannot_open_fails_the_stream_and_cancels_it(tmp_path):
    async def main():
        engine = Counting(tmp_path / "no-such-version", tokens=1 << 30)
        engine.more.set()
        server = FeedServer(str(tmp_path / "feed.sock"), engine, 1 << 20)
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        with pytest.raises(Unavailable) as caught:
            await anext(client.generate(pb.ModelInferRequest(id="s"), 5.0))
        deadline = asyncio.get_running_loop().time() + 10
        while not engine.ended and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        await server.close()
        arena.close()
        return str(caught.value), engine.ended

    message, ended = asyncio.run(main())
    assert "cannot open the model's tokenizer" in message and "tokenizer.json" in message
    assert ended == ["cancelled"]


def test_a_stream_closed_early_is_cancelled_in_the_engine_and_so_is_a_lost_front_end(
        tmp_path, tokenizer_dir):
    async def ended_with(engine: Counting, count: int) -> None:
        deadline = asyncio.get_running_loop().time() + 10
        while len(engine.ended) < count and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)

    async def main():
        engine = Counting(tokenizer_dir, tokens=1 << 30)  # runs until cancelled
        engine.more.set()
        server = FeedServer(str(tmp_path / "feed.sock"), engine, 1 << 20)
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        stream = client.generate(pb.ModelInferRequest(id="a"), 5.0)
        await anext(stream)
        await stream.aclose()  # the client went away: a CANCEL frame
        await ended_with(engine, 1)
        after_cancel = list(engine.ended)
        other = await FeedClient.connect(server.path, Arena(1 << 16))
        await anext(other.generate(pb.ModelInferRequest(id="b"), 5.0))
        other._transport.close()  # a front end lost: its streams end with it
        await ended_with(engine, 2)
        await server.close()
        arena.close()
        return after_cancel, engine.ended

    after_cancel, ended = asyncio.run(main())
    assert after_cancel == ["cancelled"]
    assert ended == ["cancelled", "cancelled"]


def test_the_served_versions_tokenizers_are_opened_before_their_first_stream(
        tmp_path, tokenizer_dir):
    """Named when a front end connects and when a version loads, each once."""
    async def main():
        served = {("torch-generative", str(tokenizer_dir))}
        server = FeedServer(str(tmp_path / "feed.sock"), Counting(tokenizer_dir, 1), 1 << 20,
                            tokenizers=lambda: set(served))
        arena = Arena(1 << 16)
        client = await FeedClient.connect(server.path, arena)
        deadline = asyncio.get_running_loop().time() + 10
        while not client._tokenizers and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        at_connect = dict(client._tokenizers)
        later = tmp_path / "v2"
        later.mkdir()
        (later / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
        served.add(("torch-generative", str(later)))
        server.announce()
        while len(client._tokenizers) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.005)
        opened = [await opening for opening in client._tokenizers.values()]
        await server.close()
        arena.close()
        return at_connect, opened

    at_connect, opened = asyncio.run(main())
    assert list(at_connect) == [("torch-generative", str(tokenizer_dir))]
    assert [tokenizer.decode([1, 2]) for tokenizer in opened] == ["w1 w2"] * 2
