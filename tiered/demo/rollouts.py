"""`tiered demo` (`make demo`): the whole system on this machine, end to end.

Trains the sample digits models (once; they are kept in build/models),
starts the local system (an agent per tier, the router, the controller),
applies examples/digits.yaml (version 1 on three tiers), sends steady
traffic through the router with the unmodified tritonclient, and rolls out
two new versions the way a user would, by applying a changed spec:

- examples/digits-v2.yaml, v1's network retrained: it must pass every stage
  and be promoted;
- examples/digits-v3.yaml, a much heavier network: its p95 and joules per
  inference go up, and it must be rolled back in its first stage.

Beside it, on the same system, the generative act: examples/tinyllama.yaml
(a tiny Llama checkpoint, trained once into build/models) is applied with
digits v1 and built in the background; once it serves on three tiers,
`tiered load` sends it text prompts through the router, tinyllama-v2.yaml
(the same greedy output) must be promoted and tinyllama-v3.yaml (slower per
token) rolled back, judged on time to first token and per output token.

Last, the vision-language act: examples/tinyvlm.yaml (a small LLaVA-style
checkpoint trained once on the digits into build/models) is built for
each tier, both its stages a version, and once it serves it answers
questions about held-out digits, sent with their images through the
router, in words: kept to each tier in turn, then split (the edge encodes,
the datacenter answers from the visual tokens).

Each controller decision and each judged window prints as it happens; at the
end a report (HTML with plots, and JSON) is written, and the demo checks the
outcomes and that no client request failed.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiered import names
from tiered.cli.live import LiveLines
from tiered.controller.host.state import StateLayout
from tiered.controller.pinning import read_documents
from tiered.controller.reconciler import decode_status
from tiered.controller.store import StateStore
from tiered.controller.verbs import apply_file
from tiered.demo.report import write_report
from tiered.local.processes import interruptible
from tiered.local.supervisor import (
    ControllerSettings,
    LocalSystem,
    LocalUp,
    RouterPorts,
    prepare_sample_models,
)
from tiered.rollout import snapshot
from tiered.rollout.progress import hold_key, progress_line
from tiered.rollout.status import RolloutStatus
from tiered.router.forward import SERVED_TIER

# The examples of the source tree: the demo runs from a checkout.
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODEL = "digits"
TIER_MIX = {"edge": 0.6, "regional": 0.25, "datacenter": 0.15}  # where clients sit
RATE_PER_S = 80.0
CONCURRENCY = 8
USERS = 500  # distinct tiered-key values: each user sticks to one version
SERVED_TIMEOUT_S = 300.0  # a v1's builds on three tiers (tinyllama's beside the digits act)


@dataclass
class Traffic:
    """A paced client load through the router; counts every answer."""

    address: str
    images: np.ndarray
    rate_per_s: float = RATE_PER_S
    outcomes: Counter = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def finish(self) -> None:
        self.stop.set()
        if self._thread is not None:
            self._thread.join(30)

    async def _run(self) -> None:
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as aioclient

        rng = np.random.default_rng(0)
        tiers, shares = list(TIER_MIX), list(TIER_MIX.values())
        interval = CONCURRENCY / self.rate_per_s
        async with aioclient.InferenceServerClient(self.address) as client:
            async def worker(index: int) -> None:
                next_at = time.monotonic() + index * interval / CONCURRENCY
                while not self.stop.is_set():
                    image = self.images[rng.integers(len(self.images))][None]
                    tensor = grpcclient.InferInput("input", list(image.shape), "FP32")
                    tensor.set_data_from_numpy(image)
                    headers = {"tiered-tier": str(rng.choice(tiers, p=shares)),
                               "tiered-key": f"user-{rng.integers(USERS)}"}
                    try:
                        await client.infer(MODEL, [tensor], headers=headers, client_timeout=10)
                        self.outcomes["ok"] += 1
                    except Exception as error:  # noqa: BLE001 -- counted and shown
                        self.outcomes[f"failed: {str(error)[:120]}"] += 1
                    next_at += interval
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))

            await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))


def _wait_until_served(address: str, image: np.ndarray, say: Callable[[str], None],
                       timeout_s: float = 60.0) -> None:
    """Until the router answers on every tier (it reads the table within a second)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(address)
    tensor = grpcclient.InferInput("input", list(image.shape), "FP32")
    tensor.set_data_from_numpy(image)
    deadline = time.monotonic() + timeout_s
    for tier in TIER_MIX:
        while True:
            try:
                # Strict: a hint alone is a preference, which another tier would answer.
                client.infer(MODEL, [tensor], client_timeout=10,
                             headers={"tiered-tier": tier, "tiered-tier-strict": "true"})
                break
            except InferenceServerException as error:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the router does not serve {MODEL} on {tier}: "
                                       f"{error}") from error
                time.sleep(0.2)
    say(f"the router at {address} answers on {', '.join(TIER_MIX)}")


def _status(store: StateStore, model: str = MODEL) -> RolloutStatus | None:
    return decode_status(model, store.get(model).status).rollout


class Undecided(Exception):
    """A rollout the demo waits on stopped short of its outcome: paused, or
    still going at the deadline. Its message is the status's own."""


def _follow(store: StateStore, up: LocalUp, done: Callable[[RolloutStatus | None], bool],
            last_id: int, timeout_s: float, out: LiveLines, prefix: str = "  ",
            model: str = MODEL, supervise: bool = True) -> int:
    """Show new rollout snapshots until `done(status)`: a line for each
    decision, the stage's hold as a live line (in place on a terminal; piped,
    when its reason changes). Returns the last history id shown. Raises
    Undecided on a pause (nothing goes on by itself then) or at the timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if supervise:  # one thread looks after the processes
                up.restart_dead()
                up.echo_controller(decisions=False)  # each is a line of its own here
            for entry_id, t, kept in store.history(model, after_id=last_id):
                snap = snapshot.from_record(kept)
                line = prefix + progress_line(t, snap, short=True)
                if snap.action == names.Action.HOLD:
                    out.live(model, line, hold_key(snap))
                else:
                    out.say(line)
                last_id = entry_id
            status = _status(store, model)
            if done(status):
                return last_id
            message = decode_status(model, store.get(model).status).message
            if status is not None and status.phase == names.Phase.PAUSED:
                raise Undecided(f"{model}: paused: {message}")
            if time.monotonic() > deadline:
                raise Undecided(f"{model}: no outcome within {timeout_s:.0f} s: {message}")
            time.sleep(0.5)
    finally:
        out.end(model)


def _timed(store: StateStore, model: str) -> list[tuple[float, snapshot.Snapshot]]:
    """The model's history for the report: each snapshot with its seconds
    since the first."""
    history = store.history(model)
    t0 = history[0][1] if history else 0.0
    return [(t - t0, snapshot.from_record(kept)) for _, t, kept in history]


def rollout_timeout_s(spec_file: Path, builds_s: float = 180.0) -> float:
    """How long the demo waits for a rollout of `spec_file`: its builds, then
    every stage to its maxDurationSeconds (a stage undecided then pauses, and
    the wait ends there)."""
    from tiered.rollout.spec import load_tiered_model

    (document,) = read_documents(spec_file)
    spec = load_tiered_model(document)
    return builds_s + sum(stage.max_duration_s for stage in spec.rollout.stages)


GENERATIVE = "tinyllama"
PREFIX = f"  [{GENERATIVE}] "  # the generative act's lines
GENERATIVE_LOAD = ("--rate", "20", "--max-tokens", "16", "--stream-share", "0.3",
                   "--tier", "edge,regional,datacenter", "--timeout", "20")

def prepare_tinyllama(models: Path, say: Callable[[str], None]) -> None:
    """Train the tiny Llama checkpoints into `models` unless they are there."""
    from tiered.models import tinyllama

    for variant in tinyllama.VARIANTS:
        if (models / f"tinyllama-{variant}" / "config.json").is_file() \
                and (models / tinyllama.EVAL_FILE).is_file():
            continue
        started = time.monotonic()
        path = tinyllama.write_tinyllama(models, variant)
        say(f"trained tinyllama {variant} in {time.monotonic() - started:.1f} s -> {path}")


@dataclass
class GenerativeAct:
    """The generative act, in a thread of its own beside the digits act (see
    the module docstring); its checks are kept for the end."""

    state: Path
    up: LocalUp
    router: str
    models: Path
    out: Path
    terminal: LiveLines
    checks: list[tuple[str, bool]] = field(default_factory=list)
    _thread: threading.Thread | None = None
    _load: Any = None  # the `tiered load` process, while it runs

    def say(self, line: str) -> None:
        self.terminal.say(f"{PREFIX}{line}")

    def check(self, what: str, ok: bool) -> None:
        self.checks.append((what, bool(ok)))
        self.say(f"[{'ok' if ok else 'FAILED'}] {what}")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> list[tuple[str, bool]]:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.check(f"the generative act ended within {timeout_s:.0f} s more", False)
        return self.checks

    def close(self) -> None:
        """Stop the load, whatever state the act is in (the demo is ending)."""
        if self._load is not None and self._load.poll() is None:
            self._load.kill()
            self._load.wait()

    def _run(self) -> None:
        try:
            self._act()
        except Exception as error:  # noqa: BLE001 -- a failed act is a failed check
            self.check(f"the generative act ran to its end ({type(error).__name__}: "
                       f"{error})", False)

    def _act(self) -> None:
        import subprocess

        def served(status) -> bool:
            return status is not None and status.stable_version == 1 and next(
                (c.status == "True" for c in decode_status(GENERATIVE, store.get(
                    GENERATIVE).status).conditions if c.type == "Ready"), False)

        with StateStore(StateLayout(self.state.resolve()).store) as store:
            last = _follow(store, self.up, served, 0, SERVED_TIMEOUT_S, self.terminal,
                           PREFIX, GENERATIVE, supervise=False)
            self.say("v1 serves on three tiers; `tiered load` sends it text prompts "
                     "through the router (greedy, 30% streamed)")
            log = self.out / f"{GENERATIVE}-load.log"
            with open(log, "w") as output:
                load = self._load = subprocess.Popen(
                    [sys.executable, "-m", "tiered", "load", GENERATIVE, "--router",
                     self.router, *GENERATIVE_LOAD, "--inputs",
                     str(self.models / "tinyllama-eval.json")],
                    stdout=output, stderr=subprocess.STDOUT, env=interruptible())
            try:
                time.sleep(3.0)
                self.say("tiered apply -f examples/tinyllama-v2.yaml: the same greedy output")
                v2 = EXAMPLES / "tinyllama-v2.yaml"
                apply_file(store, v2)
                last = _follow(store, self.up, lambda s: s is not None and s.canary_version
                               is None and s.stable_version == 2 or s.phase
                               == names.Phase.ROLLED_BACK,
                               last, rollout_timeout_s(v2), self.terminal, PREFIX,
                               GENERATIVE, False)
                self.check("tinyllama v2 promoted through every stage",
                           _status(store, GENERATIVE).stable_version == 2)
                self.say("tiered apply -f examples/tinyllama-v3.yaml: slower per token")
                v3 = EXAMPLES / "tinyllama-v3.yaml"
                apply_file(store, v3)
                last = _follow(store, self.up, lambda s: s is not None and s.canary_version
                               == 3 and s.phase in (names.Phase.PROMOTED,
                                                    names.Phase.ROLLED_BACK),
                               last, rollout_timeout_s(v3), self.terminal, PREFIX,
                               GENERATIVE, False)
                final = _status(store, GENERATIVE)
                self.check("tinyllama v3 rolled back on token latency",
                           final.phase == names.Phase.ROLLED_BACK and final.stable_version == 2
                           and any(m in final.message for m in ("ttft", "tpot")))
            except Undecided as undecided:
                self.check(f"the generative act's rollouts decided ({undecided})", False)
            finally:
                load.send_signal(signal.SIGINT)
                load.wait(60)
            summary = [line for line in log.read_text().splitlines()
                       if line.startswith("total:")] or [""]
            self.say(f"tiered load {summary[0]}")
            self.check("every generative request answered",
                       load.returncode == 0 and " errors 0 " in summary[0])
            history = _timed(store, GENERATIVE)
        html, _ = write_report(history, self.out / GENERATIVE,
                               "tiered demo: tinyllama v1 -> v2 (promoted) -> v3 (rolled back)",
                               {"traffic": " ".join(GENERATIVE_LOAD), "load": summary[0]})
        self.say(f"report: {html}")


def _digits_rollouts(store: StateStore, up: LocalUp, last: int, terminal: LiveLines,
                     check: Callable[[str, bool], None]) -> None:
    """Steps 5 and 6 once v2 is applied: v2 promoted, then v3 rolled back."""
    v2, v3 = EXAMPLES / "digits-v2.yaml", EXAMPLES / "digits-v3.yaml"
    last = _follow(store, up, lambda s: s is not None and s.phase == names.Phase.PROMOTED
                   and s.stable_version == 2, last, rollout_timeout_s(v2), terminal)
    check("version 2 promoted through every stage", _status(store).stable_version == 2)

    terminal.say("6. tiered apply -f examples/digits-v3.yaml: a heavier network")
    apply_file(store, v3)
    # Either end is an outcome: promoted, v3 is stable (the canary cleared).
    _follow(store, up, lambda s: s is not None and (
        s.phase == names.Phase.ROLLED_BACK and s.canary_version == 3
        or s.phase == names.Phase.PROMOTED and s.stable_version == 3),
        last, rollout_timeout_s(v3), terminal)
    final = _status(store)
    said = "" if final.phase == names.Phase.ROLLED_BACK else \
        f" (it was {final.phase}: {decode_status(MODEL, store.get(MODEL).status).message})"
    check(f"version 3 rolled back automatically{said}",
          final.phase == names.Phase.ROLLED_BACK and final.stable_version == 2)
    # On evidence, whichever stage found it: the heavy network costs edge's
    # INT8 several times v2's whole serving path a request, which the first
    # stage shows.
    failed = (final.last_analysis.with_outcome(names.Outcome.FAILED)
              if final.last_analysis is not None else ())
    check(f"on a failed analysis ({', '.join(sorted({m.label for m in failed})) or 'none'}) "
          f"in stage {final.stage_index + 1}", bool(failed))


VISION_LANGUAGE = "tinyvlm"
PER_TIER, SPLIT_ASKED = 10, 20  # held-out digits the vision-language act asks about


def prepare_tinyvlm(models: Path, say: Callable[[str], None]) -> None:
    """Train the small vision-language checkpoint v1 into `models` unless it is there."""
    from tiered.models import tinyvlm

    if (models / "tinyvlm-v1" / "config.json").is_file() \
            and (models / tinyvlm.EVAL_FILE).is_file():
        return
    made = tinyvlm.write_tinyvlm(models, "v1")
    say(f"trained {made.summary()}")


def _vision_language_act(store: StateStore, up: LocalUp, router: str, models: Path,
                         terminal: LiveLines, check: Callable[[str, bool], None]) -> None:
    """examples/tinyvlm.yaml on three tiers; once it serves, questions about
    held-out digits through the router, answered in words: kept to each tier
    in turn (`tiered-tier-strict`), then split across edge and datacenter."""
    from tiered.models import tinyvlm

    def served(status) -> bool:
        return status is not None and status.stable_version == 1 and next(
            (c.status == "True" for c in decode_status(VISION_LANGUAGE, store.get(
                VISION_LANGUAGE).status).conditions if c.type == "Ready"), False)

    terminal.say("7. tiered apply -f examples/tinyvlm.yaml: a small vision-language model "
                 "(both stages built for each tier)")
    apply_file(store, EXAMPLES / "tinyvlm.yaml")
    _follow(store, up, served, 0, SERVED_TIMEOUT_S, terminal, "  ", VISION_LANGUAGE)
    data = np.load(models / tinyvlm.EVAL_FILE)
    asked = iter(zip(data["image"], data["label"], strict=True))

    def ask(count: int, headers: dict[str, str], shown: str) -> tuple[int, set[str]]:
        """`count` held-out digits asked with `headers`: how many were answered
        right, and the tiers that answered."""
        right, tiers = 0, set()
        for index, (image, label) in enumerate(itertools.islice(asked, count)):
            responses = ask_streamed(router, VISION_LANGUAGE, "what digit is this?", headers,
                                     image=image.astype(np.uint8))
            said = answer_text(responses)
            right += said == tinyvlm.NUMBER_WORDS[int(label)]
            tiers |= {r.get_response().parameters[SERVED_TIER].string_param
                      for r in responses}
            if index < 2:
                terminal.say(f"  an image of a {label}{shown}: 'what digit is this?' -> {said!r}")
        return right, tiers

    for tier in names.TIERS:
        right, tiers = ask(PER_TIER, {"tiered-tier": tier, "tiered-tier-strict": "true"},
                           f", on {tier}")
        check(f"tinyvlm answers {PER_TIER} held-out digits on {tier} through the router "
              f"({right} right; answered by {', '.join(sorted(tiers))})",
              right >= 0.9 * PER_TIER and tiers == {tier})
    terminal.say("  split (`tiered-split: true`): the edge encodes each image, the "
                 "datacenter answers from its visual tokens")
    before = _split_bytes(up.router.metrics_url)
    right, tiers = ask(SPLIT_ASKED, {"tiered-split": "true"}, ", split")
    sent = {what: count - before.get(what, 0.0)
            for what, count in _split_bytes(up.router.metrics_url).items()}
    check(f"tinyvlm answers {SPLIT_ASKED} more digits split across edge and datacenter "
          f"({right} right; {sent.get('image', 0) / SPLIT_ASKED:,.0f} image bytes a request in, "
          f"{sent.get('visual_tokens', 0) / SPLIT_ASKED:,.0f} visual-token bytes on)",
          right >= 0.9 * SPLIT_ASKED and sent.get("visual_tokens", 0) > 0
          and tiers == {"datacenter"})


def _split_bytes(metrics_url: str | None) -> dict[str, float]:
    """The router's `tiered_router_split_bytes_total` for the vision-language
    model, by what was sent (image, visual_tokens); {} without /metrics."""
    import re
    import urllib.request

    if metrics_url is None:
        return {}
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return {what: float(value) for what, value in re.findall(
        r'^tiered_router_split_bytes_total{[^}]*model="' + VISION_LANGUAGE
        + r'"[^}]*what="(\w+)"[^}]*} (\S+)$', text, re.M)}


def ask_streamed(address: str, model: str, question: str, headers=None,
                 **tensors: np.ndarray) -> list:
    """One streamed request (`text_input` and the named arrays) with the real
    tritonclient: its responses up to the final one; an error is raised."""
    import queue

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    inputs = [grpcclient.InferInput("text_input", [1], "BYTES")]
    inputs[0].set_data_from_numpy(np.array([question.encode()], dtype=object))
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    answers: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(address) as client:
        client.start_stream(lambda result, error: answers.put(error or result), headers=headers)
        try:
            client.async_stream_infer(model, inputs)
            responses = []
            while True:
                answer = answers.get(timeout=60)
                if isinstance(answer, Exception):
                    raise answer
                responses.append(answer)
                if answer.get_response().parameters["triton_final_response"].bool_param:
                    return responses
        finally:
            client.stop_stream()


def answer_text(responses: list) -> str:
    """The text a stream's responses carried, stripped."""
    return "".join(t.decode() for r in responses for t in r.as_numpy("text_output")).strip()


def run(out: Path = Path("build/demo"), models: Path = Path("build/models"),
        generative: bool = True) -> int:
    """The rollout demo; with `generative`, the generative act runs beside it."""
    started = time.monotonic()
    checks: list[tuple[str, bool]] = []

    terminal = LiveLines()  # both acts write through it, live lines in place on a terminal

    def say(line: str) -> None:
        terminal.say(f"  {line}")

    def check(what: str, ok: bool) -> None:
        checks.append((what, bool(ok)))
        say(f"[{'ok' if ok else 'FAILED'}] {what}")

    terminal.say(f"1. Sample models in {models} (trained once, then reused)")
    prepare_sample_models(models.resolve(), say)
    if generative:
        prepare_tinyllama(models.resolve(), say)
        prepare_tinyvlm(models.resolve(), say)
    if models.resolve() != (EXAMPLES.parent / "build" / "models").resolve():
        sys.exit(f"tiered demo: the examples read their models from build/models; run it "
                 f"from {EXAMPLES.parent}")

    state = out / "state"
    shutil.rmtree(state, ignore_errors=True)
    system = LocalSystem(state_dir=str(state), router=RouterPorts(port=0),
                         # two builds at once: a digits build never waits behind a
                         # tiny Llama's
                         controller=ControllerSettings(interval_s=1.0, max_builds=2))
    up = LocalUp(system, EXAMPLES, progress=say)
    act: GenerativeAct | None = None
    terminal.say("2. Starting the local system: one agent per tier, the router, the controller")
    try:
        running = up.start()
        with StateStore(StateLayout(state.resolve()).store) as store:
            terminal.say("3. tiered apply -f examples/digits.yaml: version 1 on three tiers")
            apply_file(store, EXAMPLES / "digits.yaml")
            last = _follow(store, up, lambda s: s is not None and s.stable_version == 1,
                           0, SERVED_TIMEOUT_S, terminal)
            images = np.load(models / "digits-eval.npz")["input"]
            _wait_until_served(running.router, images[:1], say)
            traffic = Traffic(running.router, images)
            traffic.start()
            terminal.say(f"4. Traffic: {RATE_PER_S:g} requests/s through the router at "
                  f"{running.router}, clients on "
                  + ", ".join(f"{t} {s:.0%}" for t, s in TIER_MIX.items()))
            time.sleep(5.0)

            terminal.say("5. tiered apply -f examples/digits-v2.yaml: v1 retrained, rolled out in "
                  "stages")
            apply_file(store, EXAMPLES / "digits-v2.yaml")
            if generative:
                terminal.say("   and tiered apply -f examples/tinyllama.yaml: a tiny Llama, built in "
                      "the background; its act runs beside this one")
                apply_file(store, EXAMPLES / "tinyllama.yaml")
                act = GenerativeAct(state, up, running.router, models.resolve(), out, terminal)
                act.start()
            try:
                _digits_rollouts(store, up, last, terminal, check)
            except Undecided as undecided:
                check(f"the digits rollouts decided ({undecided})", False)
            time.sleep(3.0)  # answers in flight while the table changes
            traffic.finish()
            if act is not None:
                terminal.say("   waiting for the generative act")
                checks += act.join(SERVED_TIMEOUT_S + sum(rollout_timeout_s(
                    EXAMPLES / f"{GENERATIVE}-{v}.yaml") for v in ("v2", "v3")))
            if generative:
                try:
                    _vision_language_act(store, up, running.router, models.resolve(),
                                         terminal, check)
                except Undecided as undecided:
                    check(f"tinyvlm served ({undecided})", False)

            history = _timed(store, MODEL)
        ok = traffic.outcomes["ok"]
        failed = {k: v for k, v in traffic.outcomes.items() if k != "ok"}
        terminal.say(f"8. Traffic: {ok} answered, {sum(failed.values())} failed")
        for what, count in failed.items():
            terminal.say(f"     {count} x {what}")
        check("every client request answered", ok > 0 and not failed)
        html, js = write_report(history, out,
                                "tiered demo: digits v1 -> v2 (promoted) -> v3 (rolled back)",
                                {"requests answered": ok, "requests failed": sum(failed.values()),
                                 "traffic": f"{RATE_PER_S:g}/s, {CONCURRENCY} clients",
                                 "demo seconds": round(time.monotonic() - started, 1)})
        terminal.say(f"9. Report: {html} and {js}")
    except Undecided as undecided:  # v1 never served: nothing to roll out
        check(f"version 1 served ({undecided})", False)
    finally:
        if act is not None:
            act.close()
        up.stop()
    passed = sum(ok for _, ok in checks)
    terminal.say(f"Demo {'passed' if passed == len(checks) else 'FAILED'}: {passed}/{len(checks)} "
          f"checks in {time.monotonic() - started:.0f} s")
    return 0 if passed == len(checks) else 1
