"""`tiered demo --protocol`: the whole path of one request, on this machine.

Builds a sample model into a model repository, starts a real agent process on
loopback, and talks to it with the unmodified tritonclient the way users do:
metadata, single and batched requests, concurrent requests merged by the
dynamic batcher, a streamed exchange, a bad request, and the statistics.
Every answer is checked against ONNX Runtime run in this process.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tiered import names
from tiered.agent.repository import model_file, write_config
from tiered.local.processes import AgentProcess
from tiered.models import zoo

MODEL = "mlp"
FEATURES = 16


def _client_modules():
    try:
        import tritonclient.grpc as grpcclient
        import tritonclient.grpc.aio as aioclient
    except ImportError:
        sys.exit("tiered demo needs tritonclient: pip install 'tiered[demo]'")
    return grpcclient, aioclient


def build_repository(root: Path) -> Path:
    path = zoo.mlp(model_file(root, MODEL, 1), in_features=FEATURES, out_features=4)
    write_config(root, MODEL, {
        "max_batch_size": 32,
        "dynamic_batching": {"max_queue_delay_us": 500, "preferred_batch_sizes": [32]},
    })
    return path


def _inputs(grpcclient, batch: np.ndarray):
    tensor = grpcclient.InferInput("input", list(batch.shape), "FP32")
    tensor.set_data_from_numpy(batch)
    return [tensor]


async def _concurrent(aioclient, address: str, grpcclient, rows: np.ndarray) -> np.ndarray:
    async with aioclient.InferenceServerClient(address) as client:
        results = await asyncio.gather(
            *(client.infer(MODEL, _inputs(grpcclient, row[None])) for row in rows)
        )
    return np.concatenate([r.as_numpy("probabilities") for r in results])


def _stream(grpcclient, client, rows: np.ndarray) -> dict[str, np.ndarray]:
    answers: dict[str, np.ndarray] = {}
    errors: list[str] = []

    def on_answer(result, error):
        if error is not None:
            errors.append(str(error))
        else:
            answers[result.get_response().id] = result.as_numpy("probabilities")

    client.start_stream(callback=on_answer)
    for index, row in enumerate(rows):
        client.async_stream_infer(MODEL, _inputs(grpcclient, row[None]), request_id=str(index))
    client.stop_stream()  # waits for every answer
    if errors:
        raise RuntimeError(f"stream errors: {errors}")
    return answers


def _telemetry(address: str):
    import grpc

    from tiered.protocol import telemetry_pb2 as tpb
    from tiered.protocol import telemetry_pb2_grpc as tpb_grpc

    time.sleep(1.1)  # the Stats RPC reports whole one-second slots
    with grpc.insecure_channel(address) as channel:
        return tpb_grpc.TelemetryStub(channel).Stats(tpb.StatsRequest(model_name=MODEL),
                                                     timeout=10)


def run(tier: str = "edge") -> int:
    grpcclient, aioclient = _client_modules()
    import onnxruntime as ort

    checks: list[tuple[str, bool]] = []

    def check(what: str, ok: bool) -> None:
        checks.append((what, bool(ok)))
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")

    with tempfile.TemporaryDirectory(prefix="tiered-demo-") as tmp:
        root = Path(tmp)
        print(f"1. Building a sample model into the repository {root}")
        onnx_path = build_repository(root)
        reference = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])

        print(f"2. Starting `tiered agent --tier {tier}` on loopback")
        started = time.monotonic()
        with AgentProcess(tier, root) as agent:
            print(f"   agent pid {agent.pid} listening on {agent.address} "
                  f"({time.monotonic() - started:.1f} s)")
            client = grpcclient.InferenceServerClient(agent.address)
            meta = client.get_server_metadata()
            print(f"3. Server {meta.name} {meta.version}, extensions: {', '.join(meta.extensions)}")
            check("server live and ready", client.is_server_live() and client.is_server_ready())
            model = client.get_model_metadata(MODEL)
            print(f"   model {model.name} versions {list(model.versions)} platform {model.platform}")
            for t in model.inputs:
                print(f"     input  {t.name} {t.datatype} {list(t.shape)}")
            for t in model.outputs:
                print(f"     output {t.name} {t.datatype} {list(t.shape)}")

            rng = np.random.default_rng(7)
            rows = rng.standard_normal((64, FEATURES)).astype(np.float32)
            expected = reference.run(None, {"input": rows})[0]

            print("4. One request of 4 rows")
            answer = client.infer(MODEL, _inputs(grpcclient, rows[:4])).as_numpy("probabilities")
            np.set_printoptions(precision=4, suppress=True)
            print(f"{answer}")
            check("matches ONNX Runtime in-process", np.allclose(answer, expected[:4], atol=1e-6))

            print("5. 64 concurrent single-row requests (the dynamic batcher merges them)")
            before = client.get_inference_statistics(MODEL).model_stats[0]
            merged = asyncio.run(_concurrent(aioclient, agent.address, grpcclient, rows))
            after = client.get_inference_statistics(MODEL).model_stats[0]
            executions = after.execution_count - before.execution_count
            inferences = after.inference_count - before.inference_count
            print(f"   {inferences} inferences in {executions} engine runs "
                  f"(mean batch {inferences / max(executions, 1):.1f})")
            check("all 64 answers match", np.allclose(merged, expected, atol=1e-6))

            print("6. The same rows over one bidirectional stream")
            streamed = _stream(grpcclient, client, rows[:16])
            check("16 streamed answers match",
                  len(streamed) == 16 and all(
                      np.allclose(streamed[str(i)], expected[i:i + 1], atol=1e-6)
                      for i in range(16)))

            print("7. A bad request: 15 features instead of 16")
            try:
                client.infer(MODEL, _inputs(grpcclient, rows[:1, :15].copy()))
                check("bad request refused", False)
            except grpcclient.InferenceServerException as error:
                print(f"   {error.status()}: {error.message()}")
                check("bad request refused with INVALID_ARGUMENT",
                      error.status() == "StatusCode.INVALID_ARGUMENT")

            stats = client.get_inference_statistics(MODEL).model_stats[0].inference_stats
            print("8. Statistics (ModelStatistics, Triton's shape)")
            for phase in ("success", "fail", "queue", "compute_infer"):
                d = getattr(stats, phase)
                mean_us = d.ns / d.count / 1e3 if d.count else 0.0
                print(f"   {phase:<14} count {d.count:>4}  mean {mean_us:8.1f} µs")
            telemetry = _telemetry(agent.address)
            print("9. Telemetry (tiered.v1.Telemetry, the last minute)")
            for v in telemetry.versions:
                energy = (f"{v.joules_per_inference * 1e3:.3f} mJ per inference above "
                          f"idle ({names.energy_source_label(v.energy.source)})"
                          if v.has_energy and v.inferences else "no energy figure yet")
                print(f"   {v.model_name} v{v.model_version} on {v.device}: {v.success} answered, "
                      f"engine busy {v.busy_s * 1e3:.1f} ms, {energy}")
            print(f"   Prometheus metrics: {agent.metrics_url}")
            client.close()
            print("10. Stopping the agent (SIGTERM drains in-flight requests)")
        check("agent exited cleanly", agent.stop() == 0)

    failed = [what for what, ok in checks if not ok]
    print(f"\nDemo {'passed' if not failed else 'FAILED'}: {len(checks) - len(failed)}"
          f"/{len(checks)} checks")
    return 1 if failed else 0
