"""Benchmark: the regional tier's ONNX Runtime engine on a GPU, served and in-process, in one run.

- the model: ResNet-18 (tiered.models.zoo, random weights, FP32 ONNX) built by
  `tiered build --tier regional` as the controller builds it (FP16 weights and
  compute, FP32 inputs and outputs, judged against FP32), into a repository
  whose config.yaml leaves the engine's settings to the tier profile: the
  providers the profile lists, in its order.
- served: `tiered agent --tier regional` with no front ends and with the
  profile's kind of front ends, batch-1 FP32 requests from tritonclient
  client processes (on the wire and in system shared memory), and Triton's
  `perf_analyzer` where it is on PATH (wire, system shared memory, `-b N`),
  at concurrency 1 and the top level. The same rows as bench/gpu.py's.
- in-process, the same built model at the batch sizes asked for and at every
  batch the agent formed: a plain `onnxruntime.InferenceSession.run` from
  numpy (what a script does), and tiered's own engine (`OnnxRuntimeEngine.run`)
  from one thread and from two.
- energy: NVML's total-energy counter around every window (whole GPU, idle
  draw included), as J/img.

Which providers each session really ran on is read from the sessions and the
agent's build report, never assumed: onnxruntime-gpu falls back to the CPU
silently where its CUDA libraries do not load.

Run on a GPU machine with onnxruntime-gpu: `python bench/regional.py --quick`
(about 3 minutes). `--smoke --device cpu --out PATH` checks it anywhere in
seconds (tiny images, the CPU provider, the front-ended agent alone); its numbers
mean nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # bench.common, and tiered from a checkout

from bench import common, gpu
from bench.gpu import INPUT, MODEL, OUTPUT, EnergyMeter, Reading, timed_loop
from tiered.local.processes import ServerProcess
from tiered.tables import cell

PLAIN = "plain InferenceSession.run"
ENGINE_X1 = "tiered engine.run x1"
ENGINE_X2 = "tiered engine.run x2 threads"
REFERENCE_MODES = (PLAIN, ENGINE_X1, ENGINE_X2)
TARGET_WIRE_VS_HOST = 0.5  # bench/gpu.py's targets, for the datacenter tier
TARGET_SYSTEM_VS_HOST = 0.8


@dataclass(frozen=True)
class Settings:
    device: str = "cuda"
    image_size: int = 224
    max_batch_size: int = 64
    concurrency: tuple[int, ...] = (1, 64)
    client_processes: int = 8
    warmup_s: float = 3.0
    duration_s: float = 8.0
    inprocess_batches: tuple[int, ...] = (1, 8, 16, 64)
    inprocess_s: float = 1.5
    front_ends: int = 8
    one_process: bool = True  # the agent without front ends measured too
    request_images: int = 8  # images a request in the `-b` rows
    request_timeout_s: float = 60.0
    idle_s: float = 1.0


QUICK = dict(warmup_s=2.0, duration_s=5.0, inprocess_s=0.8)
SMOKE = dict(image_size=32, max_batch_size=4, concurrency=(2,), client_processes=2,
             warmup_s=0.2, duration_s=0.5, inprocess_batches=(1,), inprocess_s=0.2,
             front_ends=2, one_process=False, request_images=2, idle_s=0.2)


def as_gpu_settings(settings: Settings) -> gpu.RunSettings:
    """bench/gpu.py's settings for its load points (served_point, perf_analyzer_point)."""
    return replace(gpu.RunSettings(), **{k: v for k, v in asdict(settings).items()
                                         if k in gpu.RunSettings.__dataclass_fields__})


# --------------------------------------------------------------------------- the model


def build_repository(root: Path, settings: Settings) -> tuple[Path, dict[str, Any]]:
    """ResNet-18 built for the regional tier into `root`; the built model and
    the build's report."""
    import yaml

    from tiered.models import zoo

    source = zoo.resnet18(root.parent / "source" / "model.onnx", image_size=settings.image_size)
    size = settings.image_size
    config = {  # no `engine:`: the regional profile's providers and sessions, as deployed
        "backend": "onnxruntime",
        "max_batch_size": settings.max_batch_size,
        "inputs": [{"name": INPUT, "datatype": "FP32", "dims": [3, size, size]}],
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "dims": [1000]}],
        "dynamic_batching": {"max_queue_size": 4096},
    }
    (root / MODEL).mkdir(parents=True)
    (root / MODEL / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    common.progress("building ResNet-18 for the regional tier (tiered build)")
    # Random weights put the top two logits close together; FP16 may swap a
    # few of them, which says nothing about the engine measured here.
    done = subprocess.run(
        [sys.executable, "-m", "tiered", "build", "--tier", "regional", "--repository",
         str(root), "--model", MODEL, "--version", "1", "--min-agreement", "0.9",
         str(source)], capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"tiered build failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads((root / MODEL / "1" / "build.json").read_text())
    return root / MODEL / "1" / "model.onnx", report


# --------------------------------------------------------------------------- in-process


class InProcess:
    """The built model in this process: a plain session and tiered's engine."""

    def __init__(self, model: Path, settings: Settings, energy: EnergyMeter) -> None:
        import onnxruntime as ort

        from tiered.engines import open_engine
        from tiered.profiles import load_profile

        self.settings, self.energy = settings, energy
        self.engine = open_engine("onnxruntime", model, load_profile("regional").onnxruntime,
                                  "the regional profile's onnxruntime settings")
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] \
            if settings.device == "cuda" else ["CPUExecutionProvider"]
        self.session = ort.InferenceSession(str(model), providers=providers)
        self.providers = {"plain": self.session.get_providers(),
                          "engine": list(self.engine.providers)}
        self.rng = np.random.default_rng(0)

    def images(self, batch: int) -> np.ndarray:
        size = self.settings.image_size
        return self.rng.standard_normal((batch, 3, size, size), dtype=np.float32)

    def modes(self, batch: int) -> list[dict[str, Any]]:
        feeds = {INPUT: self.images(batch)}
        seconds, energy = self.settings.inprocess_s, self.energy
        rows = [
            {"mode": PLAIN, **timed_loop(lambda: self.session.run(None, feeds), batch, seconds,
                                         energy)},
            {"mode": ENGINE_X1, **timed_loop(lambda: self.engine.run(feeds), batch, seconds,
                                             energy)},
            {"mode": ENGINE_X2, **timed_loop(lambda: self.engine.run(feeds), batch, seconds,
                                             energy, threads=2)},
        ]
        return [{"batch": batch, **row} for row in rows]

    def close(self) -> None:
        self.engine.close()


# --------------------------------------------------------------------------- the run


def served_setup(front_ends: int) -> str:
    return f"1 agent, {front_ends} front ends" if front_ends else gpu.ONE_PROCESS


def run(settings: Settings, smoke: bool) -> dict[str, Any]:
    energy = EnergyMeter(settings.device)
    result = common.record("regional", smoke, with_gpu=settings.device == "cuda")
    result.update(settings=asdict(settings), energy=energy.note or "nvml: total energy counter")
    common.progress(f"machine: {result['machine']}")
    load_settings = as_gpu_settings(settings)
    top = max(settings.concurrency)
    with tempfile.TemporaryDirectory(prefix="tiered-regional-bench-") as tmp:
        model, build = build_repository(Path(tmp) / "repository", settings)
        result["build"] = {key: build.get(key) for key in ("precision", "engine", "gate",
                                                           "latency")}
        idle = Reading.take(energy)
        common.sleep_until(idle.t + settings.idle_s)
        idle_s, idle_j, _ = idle.until(Reading.take(energy))
        result["idle_watts"] = common.ratio(idle_j, idle_s)

        rows: list[dict[str, Any]] = []
        inprocess = InProcess(model, settings, energy)
        result["inprocess_providers"] = inprocess.providers
        for batch in settings.inprocess_batches:
            common.progress(f"in-process batch {batch}")
            rows += inprocess.modes(batch)
        inprocess.close()  # the agent gets the GPU to itself

        served: list[dict[str, Any]] = []
        perf_analyzer = shutil.which(gpu.PERF_ANALYZER)
        if not perf_analyzer:
            result["perf_analyzer"] = f"not run: {gpu.PERF_ANALYZER} is not on PATH"
        for front_ends in (0, settings.front_ends) if settings.one_process \
                else (settings.front_ends,):
            setup = served_setup(front_ends)
            agent = common.agent("regional", Path(tmp) / "repository",
                                 extra_args=["--front-ends", str(front_ends)])
            common.progress(f"starting: {setup}")
            with common.serving([agent]) as (one,):
                result.setdefault("agent_providers", {})[setup] = providers_in_log(one)
                for shared_memory in (False, True):
                    name = f"{setup}, inputs in system shared memory" if shared_memory else setup
                    for level in settings.concurrency:
                        served.append(served_row(name, one, level, load_settings, energy,
                                                 shared_memory))
                if perf_analyzer:
                    points = [(memory, level, 1) for memory in ("none", "system")
                              for level in sorted({1, top})]
                    points.append(("system", top, settings.request_images))
                    for memory, level, images in points:
                        name = gpu.perf_analyzer_setup(setup, memory, images)
                        common.progress(f"{name}, c={level}")
                        row = gpu.perf_analyzer_point(name, one, memory, level, load_settings,
                                                      energy, images)
                        common.progress(f"  {row.get('throughput', row.get('error'))} img/s, "
                                        f"p50 {cell(row.get('p50_ms'))} ms")
                        served.append(row)
        result["served"] = served

        formed = sorted({max(1, round(r["formed_batch"])) for r in served
                         if r.get("formed_batch")} - set(settings.inprocess_batches))
        if formed:
            inprocess = InProcess(model, settings, energy)
            for batch in formed:
                common.progress(f"in-process batch {batch} (formed by the agent)")
                rows += inprocess.modes(batch)
            inprocess.close()
        result["inprocess"] = rows
    result["comparison"] = compare(served, rows)
    result["targets"] = targets(result["comparison"], settings)
    return result


def served_row(setup: str, agent: ServerProcess, concurrency: int,
               settings: gpu.RunSettings, energy: EnergyMeter,
               shared_memory: bool) -> dict[str, Any]:
    row = gpu.served_point(setup, [agent], concurrency, settings, energy, shared_memory)
    common.progress(f"  {setup} c={concurrency}: {row['throughput']:.0f} img/s, p50 "
                    f"{cell(row['p50_ms'])} ms, batch {cell(row['formed_batch'])}, "
                    f"errors {row['errors']}")
    return row


def providers_in_log(agent: ServerProcess) -> list[str]:
    """What the agent's log says about its sessions' providers (warnings when
    a provider asked for first was not the one the session got)."""
    return [line for line in agent.log_tail(200).splitlines()
            if "provider" in line.lower() or "session runs on" in line]


def compare(served: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]]) -> list:
    """Each served row against the best in-process mode at the batch it formed."""
    by = {(r["mode"], r["batch"]): r for r in rows}
    out = []
    for row in served:
        if not row.get("formed_batch"):
            continue  # a perf_analyzer run that failed
        batch = max(1, round(row["formed_batch"]))
        modes = {mode: by.get((mode, batch), {}) for mode in REFERENCE_MODES}
        best = max((m["img_per_s"] for m in modes.values() if m.get("img_per_s")),
                   default=None)
        reference_j = min((m["j_per_img"] for m in modes.values() if m.get("j_per_img")),
                          default=None)
        out.append({
            "setup": row["setup"], "concurrency": row["concurrency"],
            "formed_batch": row["formed_batch"], "reference_batch": batch,
            "served_img_per_s": row["throughput"],
            **{f"{mode} img/s": modes[mode].get("img_per_s") for mode in REFERENCE_MODES},
            "served_vs_best_host": common.ratio(row["throughput"], best),
            "p50_ms": row["p50_ms"], "j_per_img": row["j_per_img"],
            "j_per_img_vs_host": common.ratio(row["j_per_img"], reference_j),
        })
    return out


def targets(comparison: Sequence[Mapping[str, Any]], settings: Settings) -> list:
    top = max(settings.concurrency)
    fronted = served_setup(settings.front_ends)
    reference = "the best in-process mode at the formed batch"

    def ratio(setup: str) -> float | None:
        return next((r["served_vs_best_host"] for r in comparison
                     if r["setup"] == setup and r["concurrency"] == top), None)

    return [
        common.judge("served vs host", f"{fronted}: img/s @c{top}, tensors on the wire "
                     f"(tritonclient) / {reference}", ratio(fronted), ">=", TARGET_WIRE_VS_HOST),
        common.judge("perf_analyzer system shm vs host",
                     f"perf_analyzer --shared-memory system @c{top} against {fronted} / "
                     f"{reference}", ratio(gpu.perf_analyzer_setup(fronted, "system")), ">=",
                     TARGET_SYSTEM_VS_HOST),
    ]


def report(result: Mapping[str, Any]) -> str:
    inprocess = common.table(
        ["batch", "mode", "img/s", "p50 ms", "p99 ms", "J/img (nvml)", "W"],
        [[r["batch"], r["mode"], r["img_per_s"], r["p50_ms"], r["p99_ms"], r["j_per_img"],
          r["watts"]] for r in result["inprocess"]])
    served = common.table(
        ["setup", "c", "img/s", "p50 ms", "p99 ms", "batch", "err", "queue", "engine",
         "server cpu", "us/req", "J/img (nvml)"],
        [[r["setup"], r["concurrency"], r["throughput"], r["p50_ms"], r["p99_ms"],
          r["formed_batch"], r["errors"], r["agent_ms_per_request"]["queue"],
          r["agent_ms_per_request"]["engine"], r["server_cpu_cores"],
          r["engine_cpu_us_per_request"], r["j_per_img"]]
         for r in result["served"] if "error" not in r])
    comparison = common.table(
        ["setup", "c", "ref batch", "served img/s", *REFERENCE_MODES, "served/best",
         "J/img vs ref"],
        [[r["setup"], r["concurrency"], r["reference_batch"], r["served_img_per_s"],
          *(r[f"{mode} img/s"] for mode in REFERENCE_MODES), r["served_vs_best_host"],
          r["j_per_img_vs_host"]] for r in result["comparison"]])
    build = result["build"]
    return "\n\n".join([
        f"Machine: {result['machine']}\nEnergy: {result['energy']}; idle W: "
        f"{cell(result.get('idle_watts'))}",
        f"Build: {build['precision']} on {build['engine'].get('providers')}: "
        f"{build['gate']['reason']}",
        f"In-process sessions' providers: {result['inprocess_providers']}",
        "In-process (the built model)\n" + inprocess,
        "Served (batch-1 FP32 requests unless -b; queue/engine: the agent's per-request ms)\n"
        + served,
        "Served vs the in-process reference at the formed batch\n" + comparison,
        "Targets\n" + common.targets_table(result["targets"]),
        *gpu.failures(result),
    ])


def parse_args(argv: Sequence[str] | None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Settings()
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--device", default=defaults.device, choices=["cuda", "cpu"])
    parser.add_argument("--concurrency", help="comma-separated levels (default "
                        f"{','.join(map(str, defaults.concurrency))})")
    parser.add_argument("--front-ends", type=int, help="front-end processes of the agent "
                        f"measured beside its one-process self (default {defaults.front_ends})")
    common.add_arguments(parser, "regional")
    args = common.parse(parser, argv, "regional")
    settings = replace(defaults, **SMOKE) if args.smoke else defaults
    given = {"concurrency": args.concurrency and tuple(int(c) for c in
                                                       args.concurrency.split(",")),
             "front_ends": args.front_ends}
    settings = replace(settings, device=args.device,
                       **{k: v for k, v in given.items() if v is not None})
    if args.quick:
        settings = replace(settings, **QUICK)
    return settings, args


def main(argv: Sequence[str] | None = None) -> int:
    settings, args = parse_args(argv)
    result = run(settings, args.smoke)
    print(report(result))
    common.write(result, args.out)
    if args.smoke:
        return common.smoke_exit({
            "served": (result["served"], ("throughput", "p50_ms", "p99_ms")),
            "inprocess": (result["inprocess"], ("img_per_s", "p50_ms")),
            "comparison": (result["comparison"], ("served_img_per_s", "served_vs_best_host")),
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
