"""`tiered load MODEL`: real inference requests at a steady rate through the
router, with a progress line a second (sent, ok, errors, p50/p95 latency) and
a summary at the end, so a rollout has traffic to be judged on.

A generative model (a decoupled one, as its ModelConfig says) is sent text
prompts (from a prompts JSON, `{"prompts": [...]}`, or a built-in few) with
`max_tokens` and a temperature (0, greedy, by default): a share of them as
streams (ModelStreamInfer, token by token: the client sees the time to first
token), the rest as ModelInfer (the whole text: what the router shadows to
measure agreement). Its lines add output tokens a second and TTFT p50/p95.

Inputs follow the model's metadata (each input's datatype and shape, a
variable dimension taken as 1): random values, or rows drawn from an .npz of
sample inputs. Requests are sent open-loop on a fixed schedule, as clients
arrive, at most `--max-in-flight` at a time. The counting and formatting are
pure (`LoadCounts`, `synthetic_inputs`); the sending is a thin asyncio loop.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tiered.cli import flags

if TYPE_CHECKING:  # numpy is imported when a load runs: `tiered --help` stays fast
    import numpy as np

DEFAULT_ROUTER = "127.0.0.1:8000"
MAX_IN_FLIGHT = 64  # requests outstanding at once; beyond it sending waits
ERROR_KINDS_SHOWN = 5


def register(commands: argparse._SubParsersAction) -> None:
    load = commands.add_parser(
        "load", help="send inference requests at a steady rate through the router",
        description="Send real v2 inference requests for MODEL through the router at "
        "--rate requests a second, shaped from the model's metadata (random values, or "
        "rows of --inputs), and print a line a second: sent, ok, errors and the p50/p95 "
        "latency of that second's answers. Ends after --duration seconds or on Ctrl-C "
        "with a summary; exits 0 when every request was answered, 1 otherwise.")
    load.add_argument("model", help="the model's name")
    load.add_argument("--rate", type=float, default=50.0, metavar="N",
                      help="requests a second (default 50)")
    load.add_argument("--duration", type=float, metavar="S",
                      help="stop after S seconds (default: until Ctrl-C)")
    load.add_argument("--router", metavar="HOST:PORT",
                      help="the router (default: the local system's in --state, else "
                      f"{DEFAULT_ROUTER})")
    load.add_argument("--state", type=Path, default=Path(".tiered"), metavar="DIR",
                      help=flags.STATE_HELP)
    load.add_argument("--inputs", type=Path, metavar="NPZ",
                      help="sample inputs: an .npz with an array per input name (or one "
                      "array for a one-input model), one sample per row; for a generative "
                      'model a prompts JSON, {"prompts": ["...", ...]} (default: a few '
                      "built-in prompts)")
    load.add_argument("--max-tokens", type=int, default=16, metavar="N",
                      help="generative models: tokens to generate per request (default 16)")
    load.add_argument("--temperature", type=float, default=0.0, metavar="T",
                      help="generative models: sampling temperature (default 0: greedy)")
    load.add_argument("--stream-share", type=float, default=0.5, metavar="F",
                      help="generative models: the share of requests sent as streams "
                      "(token by token, TTFT measured); the rest whole (ModelInfer, what "
                      "the router shadows for agreement) (default 0.5)")
    load.add_argument("--tier", type=_tiers, metavar="TIER[,TIER...]",
                      help="send every request with the tiered-tier hint: this tier "
                      "first, another when it cannot answer; several (comma-separated): "
                      "each request hints one of them, in turn")
    load.add_argument("--timeout", type=float, default=10.0, metavar="S",
                      help="each request's deadline (default 10)")
    load.add_argument("--max-in-flight", type=int, default=MAX_IN_FLIGHT, metavar="N",
                      help=f"requests outstanding at once (default {MAX_IN_FLIGHT})")
    load.add_argument("--seed", type=int, default=0, help="random inputs' seed")
    flags.add_tls_flags(load, server=False)  # plaintext when no --tls-* flag is given
    load.set_defaults(handler=_run)


# --- pure: counting, formatting, inputs ----------------------------------------


@dataclass
class LoadCounts:
    """Requests sent and answered, and the latencies of the answers, for one
    stretch of time (a second, or the whole run)."""

    sent: int = 0
    ok: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    error_kinds: dict[str, int] = field(default_factory=dict)
    generative: bool = False  # lines show tokens and time to first token
    tokens: int = 0  # output tokens of the answers
    ttfts_ms: list[float] = field(default_factory=list)  # of the streamed answers

    def answered(self, latency_ms: float, tokens: int = 0,
                 ttft_ms: float | None = None) -> None:
        self.ok += 1
        self.latencies_ms.append(latency_ms)
        self.tokens += tokens
        if ttft_ms is not None:
            self.ttfts_ms.append(ttft_ms)

    def failed(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def add(self, other: LoadCounts) -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.errors += other.errors
        self.latencies_ms += other.latencies_ms
        self.tokens += other.tokens
        self.ttfts_ms += other.ttfts_ms
        for kind, count in other.error_kinds.items():
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + count

    def percentile(self, q: float, ttft: bool = False) -> float | None:
        import numpy as np

        values = self.ttfts_ms if ttft else self.latencies_ms
        return float(np.percentile(values, q)) if values else None

    def line(self, seconds: float = 1.0) -> str:
        """'sent 80  ok 79  errors 1  p50 3.10 ms  p95 5.20 ms'; a generative
        model's: 'sent 8  ok 8  errors 0  tok/s 128.0  ttft p50 9.10 ms  p95 12.00 ms
        total p50 60.20 ms  p95 80.00 ms', tokens a second over `seconds`."""
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"
        counted = f"sent {self.sent}  ok {self.ok}  errors {self.errors}  "
        latency = f"p50 {ms(self.percentile(50))} ms  p95 {ms(self.percentile(95))} ms"
        if not self.generative:
            return counted + latency
        return (counted + f"tok/s {self.tokens / max(seconds, 1e-9):.1f}  ttft p50 "
                f"{ms(self.percentile(50, True))} ms  p95 {ms(self.percentile(95, True))} ms  "
                f"total {latency}")


def synthetic_inputs(inputs: Sequence[tuple[str, str, Sequence[int]]],
                     rng: np.random.Generator,
                     samples: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One request's arrays for the model's inputs, (name, datatype, shape)
    each: a row of `samples` where it has the input (batch dimension 1 kept
    or added), else random values of the datatype, variable dimensions as 1."""
    import numpy as np

    from tiered.protocol.codec import dtype_of

    arrays = {}
    for name, datatype, shape in inputs:
        dims = [1 if d < 0 else int(d) for d in shape]
        if samples is not None and name in samples:
            row = samples[name][rng.integers(len(samples[name]))]
            arrays[name] = row if row.ndim == len(dims) else row[None]
            continue
        if datatype == "BYTES":
            arrays[name] = np.full(dims, b"tiered load", dtype=object)
            continue
        dtype = dtype_of(datatype)
        if dtype.kind == "f":
            arrays[name] = rng.standard_normal(dims).astype(dtype)
        elif dtype.kind == "b":
            arrays[name] = rng.integers(0, 2, dims).astype(dtype)
        else:
            arrays[name] = rng.integers(0, 10, dims).astype(dtype)
    return arrays


def read_samples(path: Path, names: Sequence[str]) -> dict[str, np.ndarray]:
    """The .npz's arrays by input name; one unnamed array serves a one-input model."""
    import numpy as np

    from tiered.errors import ConfigError

    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as error:
        raise ConfigError(f"--inputs {path}: cannot read: {error}") from error
    if len(names) == 1 and names[0] not in arrays and len(arrays) >= 1:
        first = "input" if "input" in arrays else next(iter(arrays))
        arrays = {names[0]: arrays[first]}
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ConfigError(f"--inputs {path}: no array for input {missing[0]!r} "
                          f"(has {', '.join(arrays) or 'none'})")
    return arrays


def read_prompts(path: Path) -> list[str]:
    """A prompts JSON's prompts: `{"prompts": ["...", ...]}` (tinyllama-eval.json's form)."""
    from tiered.engines.generative import read_prompts as read

    return read(path, "--inputs")


def default_prompts() -> list[str]:
    """The sample tiny Llama's eval prompts (prefixes of the sentences it learnt)."""
    from tiered.models.tinyllama import eval_prompts

    return eval_prompts()


# --- I/O ------------------------------------------------------------------------


class StreamError(Exception):
    """A stream's error response (ModelStreamInferResponse.error_message)."""


async def _decoupled(stub, model: str, timeout: float) -> bool:
    """Whether the model is decoupled (generative), as its ModelConfig says."""
    import grpc

    from tiered.protocol import grpc_service_pb2 as pb

    try:
        reply = await stub.ModelConfig(pb.ModelConfigRequest(name=model), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return reply.config.model_transaction_policy.decoupled


async def _stream(stub, request, timeout: float, metadata) -> tuple[int, float]:
    """One request on a stream of its own, read to its final response: its
    output tokens and when the first of them came (perf_counter)."""
    from tiered.protocol import messages

    call = stub.ModelStreamInfer(timeout=timeout, metadata=metadata)
    await call.write(request)
    await call.done_writing()
    tokens, first = 0, None
    async for reply in call:
        if reply.error_message:
            call.cancel()
            raise StreamError(reply.error_message)
        count = messages.token_count(reply.infer_response)
        if count and first is None:
            first = time.perf_counter()
        tokens += count
        final = reply.infer_response.parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            break
    if first is None:
        raise StreamError("the stream ended without a token")
    return tokens, first


def _tiers(value: str) -> tuple[str, ...]:
    """--tier's tiers: one, or several comma-separated."""
    tiers = tuple(part.strip() for part in value.split(","))
    for tier in tiers:
        if tier not in flags.TIER_CHOICES:
            raise argparse.ArgumentTypeError(f"{tier!r} is not a tier "
                                             f"({', '.join(flags.TIER_CHOICES)})")
    return tiers


def _router(args: argparse.Namespace) -> tuple[str, str]:
    """The router's address and where it came from (said when it does not answer)."""
    if args.router:
        return args.router, "--router"
    from tiered.controller.host.state import RunningSystem, StateLayout

    layout = StateLayout(args.state)
    running = RunningSystem.read(layout.system)
    if running is not None:
        return running.router, f"the local system's, from {layout.system}"
    return DEFAULT_ROUTER, f"the default: no local system in {args.state}"


def unreachable(router: str, source: str, code: str, details: str) -> str:
    """What to say when the router did not answer: the address tried, where it
    came from, and how to start one or name another."""
    return (f"no router answered at {router} ({source}): {code} {details}; "
            "`tiered up -f FILE` starts the local system, or --router HOST:PORT names "
            "another router")


def _security(args: argparse.Namespace):
    """TLS as the --tls-* flags say; plaintext when none is given, as the local
    system's loopback router (and tritonclient by default) speaks."""
    from tiered.protocol.security import PLAINTEXT

    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return PLAINTEXT
    return flags.security_from_args(args)


def _run(args: argparse.Namespace) -> int:
    import asyncio

    from tiered.cli.watch import until_closed
    from tiered.errors import TieredError

    if args.rate <= 0 or args.max_in_flight < 1 or args.timeout <= 0:
        print("tiered load: --rate, --timeout and --max-in-flight must be positive",
              file=sys.stderr)
        return 2
    if args.max_tokens < 1 or not 0.0 <= args.stream_share <= 1.0 or args.temperature < 0:
        print("tiered load: --max-tokens must be positive, --stream-share within 0..1 and "
              "--temperature at least 0", file=sys.stderr)
        return 2
    try:
        total = until_closed(lambda: asyncio.run(_load(args, *_router(args))))
    except TieredError as error:
        print(f"tiered load: {error}", file=sys.stderr)
        return 1
    return total


async def _load(args: argparse.Namespace, router: str, source: str = "--router") -> int:
    import asyncio

    import grpc
    import numpy as np

    from tiered.errors import ConfigError
    from tiered.protocol import grpc_service_pb2 as pb
    from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
    from tiered.protocol import messages
    from tiered.protocol.codec import to_raw
    from tiered.protocol.security import channel

    rng = np.random.default_rng(args.seed)
    async with channel(router, _security(args), aio=True) as opened:
        stub = pb_grpc.GRPCInferenceServiceStub(opened)
        try:
            metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name=args.model),
                                                timeout=args.timeout)
        except grpc.aio.AioRpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ConfigError(unreachable(router, source, error.code().name,
                                              error.details() or "")) from None
            raise ConfigError(f"{router}: no metadata for model {args.model!r}: "
                              f"{error.code().name} {error.details()}") from None
        inputs = [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs]
        generative = await _decoupled(stub, args.model, args.timeout)
        hinted = [(("tiered-tier", tier),) for tier in args.tier or ()] or [()]
        sent_count = 0
        heading = (f"load: {args.model} through {router} at {args.rate:g}/s"
                   + (f" for {args.duration:g} s" if args.duration else " until Ctrl-C"))
        if generative:
            prompts = read_prompts(args.inputs) if args.inputs else default_prompts()
            print(f"{heading}; {len(prompts)} prompts"
                  + (f" from {args.inputs}" if args.inputs else " (built in)")
                  + f", max_tokens {args.max_tokens}, temperature {args.temperature:g}, "
                  f"{args.stream_share:.0%} streamed", flush=True)
        else:
            samples = read_samples(args.inputs, [n for n, _, _ in inputs]) if args.inputs \
                else None
            print(f"{heading}; inputs {', '.join(f'{n} {d}{s}' for n, d, s in inputs)}"
                  + (f" from {args.inputs}" if samples is not None else " (random)"),
                  flush=True)

        second, total = LoadCounts(generative=generative), LoadCounts(generative=generative)
        slots = asyncio.Semaphore(args.max_in_flight)
        pending: set[asyncio.Task] = set()

        async def send(request: pb.ModelInferRequest, hints) -> None:
            started = time.perf_counter()
            try:
                if generative and rng.random() < args.stream_share:
                    tokens, ttft = await _stream(stub, request, args.timeout, hints)
                    second.answered((time.perf_counter() - started) * 1000.0, tokens,
                                    (ttft - started) * 1000.0)
                else:
                    answer = await stub.ModelInfer(request, timeout=args.timeout,
                                                   metadata=hints)
                    second.answered((time.perf_counter() - started) * 1000.0,
                                    messages.token_count(answer) if generative else 0)
            except grpc.aio.AioRpcError as error:
                second.failed(f"{error.code().name}: {(error.details() or '')[:100]}")
            except StreamError as error:
                second.failed(str(error)[:120])
            finally:
                slots.release()

        def request() -> pb.ModelInferRequest:
            message = pb.ModelInferRequest(model_name=args.model)
            arrays = ({"text_input": np.array([prompts[rng.integers(len(prompts))].encode()],
                                              dtype=object)} if generative
                      else synthetic_inputs(inputs, rng, samples))
            for name, array in arrays.items():
                datatype, shape, raw = to_raw(array)
                message.inputs.add(name=name, datatype=datatype, shape=shape)
                message.raw_input_contents.append(raw)
            if generative:
                message.parameters["max_tokens"].int64_param = args.max_tokens
                message.parameters["temperature"].double_param = args.temperature
                if args.temperature > 0:
                    message.parameters["seed"].int64_param = int(rng.integers(2**62))
            return message

        began = time.monotonic()
        next_at, next_report = began, began + 1.0
        try:
            while args.duration is None or time.monotonic() - began < args.duration:
                now = time.monotonic()
                if now >= next_report:
                    print(f"{time.strftime('%H:%M:%S')}  {second.line()}", flush=True)
                    total.add(second)
                    second = LoadCounts(generative=generative)
                    next_report += 1.0
                if now < next_at:
                    await asyncio.sleep(min(next_at, next_report) - now)
                    continue
                await slots.acquire()
                second.sent += 1
                task = asyncio.create_task(send(request(), hinted[sent_count % len(hinted)]))
                sent_count += 1
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_at += 1.0 / args.rate
        except asyncio.CancelledError:  # Ctrl-C: stop sending, finish what is out
            pass
        if pending:
            await asyncio.wait(pending, timeout=args.timeout)
        total.add(second)
    elapsed = time.monotonic() - began
    print(f"total: {total.line(elapsed)} in {elapsed:.1f} s "
          f"({total.ok / max(elapsed, 1e-9):.1f} answered/s)", flush=True)
    for kind, count in sorted(total.error_kinds.items(), key=lambda kv: -kv[1])[
            :ERROR_KINDS_SHOWN]:
        print(f"  {count} x {kind}", flush=True)
    return 0 if total.errors == 0 and total.ok > 0 else 1


