"""`tiered load MODEL`: real inference requests at a steady rate through the
router, with a progress line a second (sent, ok, errors, p50/p95 latency) and
a summary at the end, so a rollout has traffic to be judged on.

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
                      "array for a one-input model), one sample per row")
    load.add_argument("--tier", choices=flags.TIER_CHOICES,
                      help="send every request with the tiered-tier hint: this tier "
                      "first, another when it cannot answer")
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

    def answered(self, latency_ms: float) -> None:
        self.ok += 1
        self.latencies_ms.append(latency_ms)

    def failed(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    def add(self, other: LoadCounts) -> None:
        self.sent += other.sent
        self.ok += other.ok
        self.errors += other.errors
        self.latencies_ms += other.latencies_ms
        for kind, count in other.error_kinds.items():
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + count

    def percentile(self, q: float) -> float | None:
        import numpy as np

        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else None

    def line(self) -> str:
        """'sent 80  ok 79  errors 1  p50 3.10 ms  p95 5.20 ms'."""
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"
        return (f"sent {self.sent}  ok {self.ok}  errors {self.errors}  "
                f"p50 {ms(self.percentile(50))} ms  p95 {ms(self.percentile(95))} ms")


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


# --- I/O ------------------------------------------------------------------------


def _router(args: argparse.Namespace) -> str:
    if args.router:
        return args.router
    from tiered.controller.local import RunningSystem, StateLayout

    running = RunningSystem.read(StateLayout(args.state).system)
    return running.router if running is not None else DEFAULT_ROUTER


def _security(args: argparse.Namespace):
    """TLS as the --tls-* flags say; plaintext when none is given, as the local
    system's loopback router (and tritonclient by default) speaks."""
    from tiered.protocol.security import PLAINTEXT

    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return PLAINTEXT
    return flags.security_from_args(args)


def _run(args: argparse.Namespace) -> int:
    import asyncio

    from tiered.cli.verbs import until_closed
    from tiered.errors import TieredError

    if args.rate <= 0 or args.max_in_flight < 1 or args.timeout <= 0:
        print("tiered load: --rate, --timeout and --max-in-flight must be positive",
              file=sys.stderr)
        return 2
    try:
        total = until_closed(lambda: asyncio.run(_load(args, _router(args))))
    except TieredError as error:
        print(f"tiered load: {error}", file=sys.stderr)
        return 1
    return total


async def _load(args: argparse.Namespace, router: str) -> int:
    import asyncio

    import grpc
    import numpy as np

    from tiered.errors import ConfigError
    from tiered.protocol import grpc_service_pb2 as pb
    from tiered.protocol import grpc_service_pb2_grpc as pb_grpc
    from tiered.protocol.codec import to_raw
    from tiered.protocol.security import channel

    rng = np.random.default_rng(args.seed)
    async with channel(router, _security(args), aio=True) as opened:
        stub = pb_grpc.GRPCInferenceServiceStub(opened)
        try:
            metadata = await stub.ModelMetadata(pb.ModelMetadataRequest(name=args.model),
                                                timeout=args.timeout)
        except grpc.aio.AioRpcError as error:
            raise ConfigError(f"{router}: no metadata for model {args.model!r}: "
                              f"{error.code().name} {error.details()}") from None
        inputs = [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs]
        samples = read_samples(args.inputs, [n for n, _, _ in inputs]) if args.inputs else None
        hints = (("tiered-tier", args.tier),) if args.tier else ()
        print(f"load: {args.model} through {router} at {args.rate:g}/s"
              + (f" for {args.duration:g} s" if args.duration else " until Ctrl-C")
              + f"; inputs {', '.join(f'{n} {d}{s}' for n, d, s in inputs)}"
              + (f" from {args.inputs}" if samples is not None else " (random)"), flush=True)

        second, total = LoadCounts(), LoadCounts()
        slots = asyncio.Semaphore(args.max_in_flight)
        pending: set[asyncio.Task] = set()

        async def send(request: pb.ModelInferRequest) -> None:
            started = time.perf_counter()
            try:
                await stub.ModelInfer(request, timeout=args.timeout, metadata=hints)
                second.answered((time.perf_counter() - started) * 1000.0)
            except grpc.aio.AioRpcError as error:
                second.failed(f"{error.code().name}: {(error.details() or '')[:100]}")
            finally:
                slots.release()

        def request() -> pb.ModelInferRequest:
            message = pb.ModelInferRequest(model_name=args.model)
            for name, array in synthetic_inputs(inputs, rng, samples).items():
                datatype, shape, raw = to_raw(array)
                message.inputs.add(name=name, datatype=datatype, shape=shape)
                message.raw_input_contents.append(raw)
            return message

        began = time.monotonic()
        next_at, next_report = began, began + 1.0
        try:
            while args.duration is None or time.monotonic() - began < args.duration:
                now = time.monotonic()
                if now >= next_report:
                    print(f"{time.strftime('%H:%M:%S')}  {second.line()}", flush=True)
                    total.add(second)
                    second = LoadCounts()
                    next_report += 1.0
                if now < next_at:
                    await asyncio.sleep(min(next_at, next_report) - now)
                    continue
                await slots.acquire()
                second.sent += 1
                task = asyncio.create_task(send(request()))
                pending.add(task)
                task.add_done_callback(pending.discard)
                next_at += 1.0 / args.rate
        except asyncio.CancelledError:  # Ctrl-C: stop sending, finish what is out
            pass
        if pending:
            await asyncio.wait(pending, timeout=args.timeout)
        total.add(second)
    elapsed = time.monotonic() - began
    print(f"total: {total.line()} in {elapsed:.1f} s ({total.ok / max(elapsed, 1e-9):.1f} "
          "answered/s)", flush=True)
    for kind, count in sorted(total.error_kinds.items(), key=lambda kv: -kv[1])[
            :ERROR_KINDS_SHOWN]:
        print(f"  {count} x {kind}", flush=True)
    return 0 if total.errors == 0 and total.ok > 0 else 1


