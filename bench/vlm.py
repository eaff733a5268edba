"""Benchmark: a vision-language model whole on one tier against split across two.

The small trained model (`tiered models tinyvlm`, v1: questions about 8x8
digits) is built by the real `tiered build` for the edge (vision stage INT8,
decoder INT4 on onnxruntime-genai), the regional tier (vision stage FP16,
decoder on onnxruntime-genai: FP16 on CUDA, FP32 on a CPU) and the
datacenter (vision stage FP16, decoder on the torch engine), and served by
one real agent each. Two real routers over the same agents: one routes
whole (each request hinted, strict, to one tier), one allows the split
(`split: {vision: edge, decoder: datacenter}`), which the split arm asks for
with the `tiered-split` hint: the edge encodes the image, the datacenter
answers from its visual tokens.

Five arms, each at several image sizes (the digit upscaled to S x S RGB
uint8, as a camera's frame is larger than the model's input; the agent's
preprocessing resizes it): whole on each tier, split, and split with the
edge's vision stage capped at `CAP` visual tokens an image
(`generation.vision.max_visual_tokens`, set on a copy of the edge's build
served by a fourth agent: the build's gate is not asked here, and the row's
share of right answers shows what the cap costs). Each arm asks "what digit
is this?" of held-out images, `--streams` at a time, for `--requests`
requests, and reports:

- TTFT and TPOT percentiles (client side: the first response, then the gaps
  between responses), and answers right;
- the split's vision stage: its mean time, as the router measured its call
  to the edge (tiered_router_split_vision_seconds);
- the bytes a request sends upstream from the edge's site: the image when
  another tier answers whole, its visual tokens when split, none when the
  edge answers whole;
- J per request from the agents' own telemetry (`Telemetry.Stats`: each
  version's active joules over the arm, with its source: `model` on a
  machine without RAPL or NVML, an estimate), in all and per tier: split,
  the edge's share is the vision stage's and the datacenter's the decoder's.

All agents share this machine's cores: the "tiers" differ in engine and
precision, not in hardware.

Targets (benchmark targets): split TTFT p50 within 1.2x of the best whole
arm's at the same size; split upstream bytes at most 1/5 of sending the
image, at sizes of 64 px and more.

Run: `.venv/bin/python bench/vlm.py` (a few minutes, most of it training and
building; `--models DIR` reuses `tiered models tinyvlm --variant v1 --out
DIR`, `--builds DIR` each tier's build of it), `--smoke --out PATH` for a
quick check that it still runs.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

import grpc  # noqa: E402
import tritonclient.grpc as grpcclient  # noqa: E402

from bench import common  # noqa: E402
from tiered import names  # noqa: E402
from tiered.local.processes import AgentProcess, RouterProcess  # noqa: E402
from tiered.models import tinyvlm  # noqa: E402
from tiered.protocol import telemetry_pb2 as tpb  # noqa: E402
from tiered.protocol import telemetry_pb2_grpc as tpb_grpc  # noqa: E402
from tiered.telemetry.recorder import SLOT_S  # noqa: E402

MODEL, QUESTION = "tinyvlm", "what digit is this?"
TIERS = names.TIERS
ARMS = ("whole edge", "whole regional", "whole datacenter", "split", "split capped")
WHOLE_ARMS = tuple(arm for arm in ARMS if arm.startswith("whole "))
CAP = 2  # visual tokens an image the "split capped" arm's edge keeps (of 4)
SIZES, SMOKE_SIZES = (8, 64, 256, 1024), (8, 256)
TARGET_TTFT_RATIO = 1.2
TARGET_BYTES_RATIO = 0.2
BYTES_TARGET_FROM_PX = 64
SPLIT = {"vision": "edge", "decoder": "datacenter"}


def build(models: Path, tier: str, repository: Path) -> dict[str, Any]:
    """The tier's whole build of tinyvlm v1 by the CLI; its build report."""
    done = subprocess.run(
        [sys.executable, "-m", "tiered", "build", str(models / "tinyvlm-v1"), "--tier", tier,
         "--model", MODEL, "--version", "1", "--repository", str(repository),
         "--eval", str(models / tinyvlm.EVAL_FILE),
         "--calibration", str(models / tinyvlm.CALIBRATION_FILE)],
        capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tiered build --tier {tier} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def routing_table(path: Path, agents: dict[str, AgentProcess],
                  split: dict[str, str] | None) -> Path:
    """A routing table of the agents, splitting the model or not."""
    path.write_text(json.dumps({"version": 1, "models": {MODEL: {"tiers": {
        tier: {"agents": [agent.address]} for tier, agent in agents.items()},
        **({"split": split} if split else {})}}}))
    return path


def frame(image: np.ndarray, size: int) -> np.ndarray:
    """A stored digit (0..16) as an S x S RGB frame, each pixel repeated."""
    grey = np.kron(image, np.ones((size // image.shape[0],) * 2, np.uint8))
    return np.repeat(grey[:, :, None], 3, axis=2)


def ask(address: str, image: np.ndarray, headers: dict[str, str] | None
        ) -> tuple[str, float, list[float]]:
    """One streamed question: the answer, seconds to its first response, and
    the gaps between the responses after it."""
    answers: queue.Queue = queue.Queue()
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([QUESTION.encode()], dtype=object))
    pixels = grpcclient.InferInput("image", list(image.shape), "UINT8")
    pixels.set_data_from_numpy(image)
    with grpcclient.InferenceServerClient(address) as client:
        client.start_stream(partial(lambda q, result, error: q.put(
            (time.perf_counter(), error or result)), answers), headers=headers)
        started = time.perf_counter()
        client.async_stream_infer(MODEL, [text, pixels])
        said, times = [], []
        while True:
            at, answer = answers.get(timeout=120)
            if isinstance(answer, Exception):
                client.stop_stream()
                raise answer
            said += [t.decode() for t in answer.as_numpy("text_output")]
            times.append(at)
            if answer.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return "".join(said).strip(), times[0] - started, list(np.diff(times))


def version_joules(agent: AgentProcess, cursor: float) -> tuple[float, float, set[str]]:
    """The agent's versions' active joules since `cursor`, its new cursor and
    the energy sources."""
    with grpc.insecure_channel(agent.address) as channel:
        reply = tpb_grpc.TelemetryStub(channel).Stats(
            tpb.StatsRequest(model_name=MODEL, cursor=cursor), timeout=10)
    joules = sum(v.energy.joules for v in reply.versions if v.HasField("energy"))
    return joules, reply.end, {v.energy.source for v in reply.versions if v.HasField("energy")}


def split_counters(router: RouterProcess) -> dict[str, float]:
    """The router's split counters so far: the visual-token bytes it sent on
    to decoder tiers (tiered_router_split_bytes_total), and the count and
    seconds of the vision stages it asked for (tiered_router_split_vision_seconds)."""
    text = urllib.request.urlopen(router.metrics_url, timeout=10).read().decode()
    found = {}
    for key, pattern in (
            ("token_bytes", r'tiered_router_split_bytes_total\{[^}]*what="visual_tokens"[^}]*\}'),
            ("vision_count", r"tiered_router_split_vision_seconds_count\{[^}]*\}"),
            ("vision_seconds", r"tiered_router_split_vision_seconds_sum\{[^}]*\}")):
        match = re.search(pattern + r" (\S+)", text)
        found[key] = float(match.group(1)) if match else 0.0
    return found


def run_arm(arm: str, router: RouterProcess, headers: dict[str, str] | None,
            images: np.ndarray, labels: np.ndarray, size: int, streams: int,
            agents: dict[str, AgentProcess], cursors: dict[str, float]) -> dict[str, Any]:
    address = router.address
    frames = [frame(image, size) for image in images]
    before = split_counters(router)
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda f: ask(address, f, headers), frames))
    seconds = time.perf_counter() - started
    time.sleep(2 * SLOT_S)  # the agents' telemetry slots of this arm close
    by_tier, sources = {}, set()
    for tier, agent in agents.items():  # cursors by agent address
        by_tier[tier], cursors[agent.address], said = version_joules(agent,
                                                                     cursors[agent.address])
        sources |= said
    joules = sum(by_tier.values())
    expected = [tinyvlm.NUMBER_WORDS[int(label)] for label in labels]
    ttft = [r[1] for r in results]
    tpot = [gap for r in results for gap in r[2]]
    image_bytes = frames[0].nbytes
    # Split: what the router counted sending on; whole: the image itself
    # where it leaves the edge's site, else nothing.
    after = split_counters(router)
    split = arm.startswith("split")
    upstream = ((after["token_bytes"] - before["token_bytes"]) / len(results) if split
                else 0 if arm == "whole edge" else image_bytes)
    stages = after["vision_count"] - before["vision_count"]
    return {
        "arm": arm, "image_px": size, "requests": len(results), "streams": streams,
        "seconds": seconds, "requests_per_s": len(results) / seconds,
        "right": sum(r[0] == e for r, e in zip(results, expected, strict=True)) / len(results),
        "ttft_ms": common.percentiles_ms(ttft), "tpot_ms": common.percentiles_ms(tpot),
        "image_bytes": image_bytes, "upstream_bytes_per_request": upstream,
        "j_per_request": joules / len(results) if joules > 0 else None,
        # Per stage where split: the edge's joules are its vision stage's, the
        # datacenter's its decoder's; whole, one tier's (the others idle).
        "j_per_request_by_tier": {tier: j / len(results) for tier, j in by_tier.items()},
        "vision_stage_ms": (1000 * (after["vision_seconds"] - before["vision_seconds"])
                            / stages if split and stages else None),
        "energy_source": ",".join(sorted(sources)) or None,
    }


def targets(rows: Sequence[dict[str, Any]]) -> list[common.Target]:
    out = []
    for size in sorted({r["image_px"] for r in rows}):
        at = {r["arm"]: r for r in rows if r["image_px"] == size}
        best = min(at[a]["ttft_ms"]["p50_ms"] for a in WHOLE_ARMS)
        out.append(common.judge(f"split TTFT {size} px", "split TTFT p50 / best whole arm's",
                                common.ratio(at["split"]["ttft_ms"]["p50_ms"], best), "<=",
                                TARGET_TTFT_RATIO))
        if size >= BYTES_TARGET_FROM_PX:
            out.append(common.judge(
                f"split upstream bytes {size} px", "visual tokens / the image, a request",
                common.ratio(at["split"]["upstream_bytes_per_request"],
                             at["whole datacenter"]["upstream_bytes_per_request"]), "<=",
                TARGET_BYTES_RATIO))
    return out


def report(rows: Sequence[dict[str, Any]], goals: Sequence[common.Target]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return "\n\n".join([
        common.table(["arm", "image px", "req/s", "right", "TTFT p50 ms", "TTFT p95 ms",
                      "TPOT p50 ms", "vision stage ms", "upstream B/req", "J/req",
                      "J/req edge / regional / datacenter", "energy source"],
                     [[r["arm"], r["image_px"], f"{r['requests_per_s']:.1f}",
                       f"{r['right']:.0%}", ms(r["ttft_ms"]["p50_ms"]), ms(r["ttft_ms"]["p95_ms"]),
                       ms(r["tpot_ms"]["p50_ms"]), ms(r["vision_stage_ms"]),
                       f"{r['upstream_bytes_per_request']:,.0f}",
                       "-" if r["j_per_request"] is None else f"{r['j_per_request']:.4f}",
                       " / ".join(f"{r['j_per_request_by_tier'].get(t, 0.0):.4f}"
                                  for t in TIERS),
                       r["energy_source"] or "-"] for r in rows]),
        common.targets_table(goals)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=Path, help="a directory `tiered models tinyvlm "
                        "--variant v1` wrote (default: train v1 into a scratch directory)")
    parser.add_argument("--builds", type=Path, help="reuse tinyvlm v1's builds: DIR/<tier>/ "
                        "the repository `tiered build --tier <tier>` wrote, DIR/<tier>.json "
                        "its report (the command's output); default: build each tier here")
    parser.add_argument("--requests", type=int, help="requests an arm and size (default 96; "
                        "smoke 8)")
    parser.add_argument("--streams", type=int, default=4, help="requests at once (default 4)")
    common.add_arguments(parser, "vlm")
    args = common.parse(parser, argv, "vlm")
    requests = args.requests or (8 if args.smoke else 96)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    result = common.record("vlm", args.smoke)
    with tempfile.TemporaryDirectory(prefix="bench-vlm-") as scratch_name:
        scratch = Path(scratch_name)
        models = args.models
        if models is None:
            common.progress("training tinyvlm v1 (about half a minute)")
            models = scratch / "models"
            tinyvlm.write_tinyvlm(models, "v1")
        built = args.builds or scratch
        builds = {}
        for tier in TIERS:
            if args.builds is None:
                common.progress(f"building tinyvlm v1 for {tier}")
                builds[tier] = build(models, tier, built / tier)
            else:
                builds[tier] = json.loads((built / f"{tier}.json").read_text())
        data = np.load(models / tinyvlm.EVAL_FILE)
        images, labels = data["image"][:requests], data["label"][:requests]
        capped = scratch / "edge-capped"
        shutil.copytree(built / "edge", capped)
        config = yaml.safe_load((capped / MODEL / "config.yaml").read_text())
        config["generation"]["vision"]["max_visual_tokens"] = CAP
        (capped / MODEL / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        agents = {tier: AgentProcess(tier, built / tier) for tier in TIERS}
        capped_agent = AgentProcess("edge", capped)
        addresses = {**{f"whole {tier}": ("whole", {"tiered-tier": tier,
                                                    "tiered-tier-strict": "true"})
                        for tier in TIERS},
                     "split": ("split", {"tiered-split": "true"}),
                     "split capped": ("split capped", {"tiered-split": "true"})}
        rows = []
        with common.serving([*agents.values(), capped_agent]):
            routers = {name: RouterProcess(routing_table(scratch / f"{name}.json", agents,
                                                         split))
                       for name, split in (("whole", None), ("split", SPLIT))}
            routers["split capped"] = RouterProcess(routing_table(
                scratch / "split-capped.json", {**agents, "edge": capped_agent}, SPLIT))
            with common.serving(list(routers.values())):
                cursors = {}
                for agent in (*agents.values(), capped_agent):  # cursors after a warm-up
                    ask(agent.address, frame(images[0], 8), None)
                    time.sleep(2 * SLOT_S)
                    _, cursors[agent.address], _ = version_joules(agent, 0.0)
                for size in sizes:
                    for arm in ARMS:
                        router, headers = addresses[arm]
                        common.progress(f"{arm}, {size} px: {requests} requests, "
                                        f"{args.streams} at a time")
                        # The capped arm's energy: its own edge agent's, beside the datacenter's.
                        used = {**agents, "edge": capped_agent} if arm == "split capped" \
                            else agents
                        rows.append(run_arm(arm, routers[router], headers, images, labels,
                                            size, args.streams, used, cursors))
    goals = targets(rows)
    result.update({
        "settings": {"requests": requests, "streams": args.streams, "sizes": list(sizes),
                     "question": QUESTION},
        "builds": {tier: {"answers": b["answers"], "decoder": b["decoder"],
                          "gate": b["gate"]["verdict"]} for tier, b in builds.items()},
        "rows": rows, "targets": goals, "overall": common.overall(goals),
        "note": "all agents share one machine's cores; energy is each agent's versions' "
                "active joules from its own telemetry, with its source; 'split capped' is "
                f"split with the edge's vision stage keeping {CAP} of 4 visual tokens an "
                "image (max_visual_tokens on a copy of the edge build, not gated here)",
        "cap": CAP,
    })
    print(report(rows, goals))
    common.write(result, args.out)
    if args.smoke:
        return common.smoke_exit({"rows": (rows, ("requests_per_s", "ttft_ms.p50_ms",
                                                  "tpot_ms.p50_ms", "image_bytes"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
