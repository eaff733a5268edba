"""The distribution's extras: each install and image gets what it imports, and no more.

pyproject.toml is read as pip reads it (extras naming `tiered[...]` followed
to their requirements); the controller and the router are imported in a fresh
interpreter where the agent's packages cannot be imported at all.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
AGENT_ONLY = ("onnx", "onnxruntime", "onnxruntime-gpu", "opentelemetry-api",
              "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc", "torch")


# Packages that bring one ONNX Runtime build with them.
BRINGS = {"onnxruntime-genai": "onnxruntime", "onnxruntime-genai-cuda": "onnxruntime-gpu"}


def resolved(*extras: str) -> dict[str, list[Requirement]]:
    """Every requirement an install of tiered[extras] names, by package (and
    the ONNX Runtime build each of `BRINGS` pulls in)."""
    found: dict[str, list[Requirement]] = {}
    pending, seen = [*PROJECT["dependencies"]], set()
    for extra in extras:
        pending += EXTRAS[extra]
        seen.add(extra)
    while pending:
        requirement = Requirement(pending.pop())
        name = canonicalize_name(requirement.name)
        if name == "tiered":
            for extra in requirement.extras - seen:
                assert extra in EXTRAS, f"tiered[{extra}] is named but not defined"
                seen.add(extra)
                pending += EXTRAS[extra]
            continue
        found.setdefault(name, []).append(requirement)
        if name in BRINGS:
            pending.append(BRINGS[name])
    return found


def caps_below(requirements: list[Requirement]) -> set[str]:
    return {s.version for r in requirements for s in r.specifier if s.operator in ("<", "<=")}


def test_the_base_install_carries_no_engine_and_no_tracing():
    base = resolved()
    assert not set(AGENT_ONLY) & set(base)
    assert {"grpcio", "protobuf", "numpy", "aiohttp"} <= set(base)


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_no_extra_installs_two_onnx_runtimes(extra):
    assert not {"onnxruntime", "onnxruntime-gpu"} <= set(resolved(extra)), extra


def test_agent_is_the_cpu_runtime_and_gpu_the_cuda_one():
    agent, gpu = resolved("agent"), resolved("gpu")
    assert "onnxruntime" in agent and "onnxruntime-gpu" not in agent
    assert "onnxruntime-gpu" in gpu and "onnxruntime" not in gpu
    assert "nvidia-ml-py" in gpu
    # Both carry everything else an agent imports.
    for install in (agent, gpu):
        assert {"onnx", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-grpc"} <= set(
            install)


def test_test_installs_everything_the_tests_import():
    test = resolved("test")
    assert {"onnxruntime", "torch", "onnxscript", "scikit-learn", "kubernetes", "tritonclient",
            "kubernetes-validate", "grpcio-tools", "pillow"} <= set(test)
    assert "onnxruntime-gpu" not in test


def test_protobuf_is_capped_only_where_tritonclient_comes_in():
    assert not caps_below(resolved()["protobuf"]), "the base caps protobuf"
    for extra, requirements in EXTRAS.items():
        direct = {canonicalize_name(Requirement(r).name): Requirement(r) for r in requirements}
        if "protobuf" in direct and caps_below([direct["protobuf"]]):
            assert "tritonclient" in direct, f"{extra} caps protobuf without tritonclient"
        install = resolved(extra)
        if "tritonclient" in install:  # tritonclient[grpc] needs protobuf < 7
            assert caps_below(install["protobuf"]) == {"7"}, extra


def dockerfile_extras(path: str) -> set[str]:
    """The extras a Dockerfile installs (`pip install -c constraints.txt '.[a,b]'`)."""
    text = (ROOT / path).read_text()
    (match,) = re.findall(r"pip install -c constraints\.txt '\.\[([a-z,-]+)\]'", text)
    return set(match.split(","))


@pytest.mark.parametrize(("dockerfile", "runtime"), [
    ("agents/Dockerfile", "onnxruntime"),
    ("agents/Dockerfile.cuda", "onnxruntime-gpu"),
    ("controller/Dockerfile", None),
])
def test_each_image_installs_its_own_extras_from_the_constraints(dockerfile, runtime):
    installs = resolved(*dockerfile_extras(dockerfile))
    runtimes = {"onnxruntime", "onnxruntime-gpu"} & set(installs)
    assert runtimes == ({runtime} if runtime else set()), dockerfile
    if runtime is None:
        assert "kubernetes" in installs and not set(AGENT_ONLY) & set(installs)


def test_constraints_pin_every_package_exactly_and_leave_tiered_out():
    lines = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    pins = {canonicalize_name(Requirement(line).name): Requirement(line) for line in lines}
    assert "tiered" not in pins
    for name, pin in pins.items():
        (spec,) = pin.specifier
        assert spec.operator == "==" and "+" not in spec.version, pin
    assert set(resolved("dev")) <= set(pins)  # every package the tests install
    assert "constraints.txt" in (ROOT / "Makefile").read_text()


BLOCKED = ("onnx", "onnxruntime", "opentelemetry", "torch", "onnxscript", "sklearn", "pynvml")


def run_without_agent_packages(code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter where the agent's packages cannot be imported."""
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in BLOCKED)
    return subprocess.run([sys.executable, "-c", f"import sys\n{block}{code}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)


def test_the_controller_and_router_import_without_the_agents_packages():
    done = run_without_agent_packages(
        "import tiered.cli, tiered.router.server, tiered.controller.kube.controller\n"
        "import tiered.controller.kube.backend, tiered.controller.host.controller\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{BLOCKED!r} and sys.modules[m] is not None))")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_an_agent_without_its_packages_names_the_extra_to_install():
    done = run_without_agent_packages(
        "from tiered.cli import main\n"
        "sys.exit(main(['agent', '--tier', 'edge', '--model-repository', 'models']))")
    assert done.returncode == 2, done.stderr
    assert "pip install 'tiered[agent]'" in done.stderr and "tiered[gpu]" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_onnxruntime_model_without_onnxruntime_names_the_extra_to_install():
    done = run_without_agent_packages(
        "from pathlib import Path\n"
        "from tiered.engines import open_engine\n"
        "from tiered.errors import ConfigError\n"
        "try:\n"
        "    open_engine('onnxruntime', Path('m.onnx'), {}, 'config.yaml')\n"
        "except ConfigError as error:\n"
        "    print(error)\n")
    assert done.returncode == 0, done.stderr
    assert "backend: onnxruntime needs ONNX Runtime (pip install 'tiered[agent]'" in done.stdout


@pytest.mark.parametrize(("given", "kept"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_a_tiered_process_lets_torchs_idle_threads_sleep_unless_told_otherwise(given, kept):
    """The environment torch reads when it loads, as `tiered` leaves it before
    any command runs (tiered.cli.quiet_idle_threads)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    done = subprocess.run([sys.executable, "-c",
                           "import os\nfrom tiered.cli import main\ntry:\n"
                           "    main(['get', '--help'])\nexcept SystemExit:\n    pass\n"
                           "print('OMP_WAIT_POLICY', os.environ.get('OMP_WAIT_POLICY'))"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"OMP_WAIT_POLICY {kept}"
