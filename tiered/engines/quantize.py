"""Lower one FP32 ONNX artifact to a tier's precision: INT8 (static QDQ) or FP16.

Each function reads the FP32 file and writes one new ONNX file; measuring and
judging the result is `tiered.engines.build`'s job. Inputs and outputs keep
their FP32 types in every lowering, so clients never change with the tier.

This module must never touch a model repository or decide whether a result is
good enough; and it must never let onnxruntime's quantizer print to stdout,
which belongs to the `tiered build` report.
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiered.errors import EngineError

# Ways to turn calibration activations into INT8 ranges: MinMax takes the
# observed range (sensitive to outliers), Entropy the range that keeps the
# histogram's KL divergence smallest, Percentile clips the tails (99.999%).
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")


# onnxruntime's quantize_static builds its Entropy calibrator with 128
# histogram bins and 128 quantized bins, which leaves the KL-divergence search
# one candidate, the full (MinMax) range. The TensorRT recipe it follows uses
# a fine histogram and 128 quantized bins, so the ranges are computed here
# with those and handed to the quantizer as a calibration cache.
ENTROPY_BINS = 2048
ENTROPY_QUANTIZED_BINS = 128
# quantize_static's own Percentile defaults (2048 bins, 99.999%), recorded in the report.
PERCENTILE_BINS = 2048
PERCENTILE = 99.999


def quantize_int8(
    source: Path,
    target: Path,
    calibration: Sequence[Mapping[str, np.ndarray]],
    *,
    method: str,
    per_channel: bool,
    work_dir: Path,
) -> dict[str, Any]:
    """Static INT8 quantization in QDQ format for ONNX Runtime's CPU provider.

    The model is first pre-processed the way onnxruntime recommends (shape
    inference, symbolic where ONNX's own leaves a shape unknown, and graph
    optimization) so the quantizer sees every tensor's shape and fused
    patterns; `calibration` is the list of feeds (one batch each) whose
    activations set the ranges. Weights are INT8
    symmetric, per output channel when `per_channel`; activations INT8.
    Returns the calibrator's parameters, for the build report.
    """
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.calibrate import create_calibrator
    from onnxruntime.quantization.shape_inference import quant_pre_process

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }
    if method not in methods:
        raise EngineError(
            f"calibration_method: {method!r} is not one of {', '.join(CALIBRATION_METHODS)}"
        )
    if not calibration:
        raise EngineError("calibration: INT8 quantization needs at least one calibration batch")

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self._batches = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self._batches, None)
            return None if batch is None else dict(batch)

    prepared = work_dir / "preprocessed.onnx"
    options: dict[str, Any] = {"method": method, "preprocessed": True}
    # The quantizer announces its progress with print(); the CLI's stdout
    # carries the JSON report, so its chatter goes to stderr instead.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            quant_pre_process(str(source), str(prepared),
                              skip_symbolic_shape=not needs_symbolic_shapes(source))
        except Exception as error:  # onnxruntime raises untyped errors
            raise EngineError(f"{source}: onnxruntime's quantization pre-processing failed: "
                              f"{error}") from error
        arguments: dict[str, Any] = {"calibration_data_reader": Feeds()}
        try:
            if method == "entropy":
                if "calibration_cache_path" not in inspect.signature(quantize_static).parameters:
                    raise EngineError(
                        "calibration_method: entropy needs an onnxruntime whose quantize_static "
                        f"takes a calibration cache (this is {_ort_version()}); its own Entropy "
                        "calibrator reduces to MinMax; use minmax or percentile"
                    )
                calibrator = create_calibrator(
                    prepared, None, augmented_model_path=str(work_dir / "augmented.onnx"),
                    calibrate_method=CalibrationMethod.Entropy,
                    extra_options={"num_bins": ENTROPY_BINS,
                                   "num_quantized_bins": ENTROPY_QUANTIZED_BINS},
                )
                calibrator.collect_data(Feeds())
                cache = work_dir / "calibration-cache.json"
                _save_ranges(calibrator.compute_data(), cache)
                arguments = {"calibration_data_reader": None, "calibration_cache_path": str(cache)}
                options.update(histogram_bins=ENTROPY_BINS, quantized_bins=ENTROPY_QUANTIZED_BINS)
            elif method == "percentile":
                options.update(histogram_bins=PERCENTILE_BINS, percentile=PERCENTILE)
            quantize_static(
                str(prepared),
                str(target),
                quant_format=QuantFormat.QDQ,
                per_channel=per_channel,
                activation_type=QuantType.QInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=methods[method],
                extra_options={"CalibPercentile": PERCENTILE},
                **arguments,
            )
        except EngineError:
            raise
        except Exception as error:
            raise EngineError(f"{source}: INT8 quantization failed: {error}") from error
    return options


def needs_symbolic_shapes(source: Path) -> bool:
    """Whether ONNX's shape inference leaves some tensor's shape unknown (or
    the graph has subgraphs, which are not checked here), so that onnxruntime's
    symbolic shape inference is worth running: it adds nothing to a network
    whose shapes ONNX already infers (a CNN with a symbolic batch: the same
    nodes and initializers either way), and its module imports torch where
    torch is installed, seconds of every INT8 build."""
    import onnx

    model = onnx.load(str(source), load_external_data=False)
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for node in model.graph.node for a in node.attribute):
        return True
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # onnx raises untyped errors: leave it to the symbolic inference
        return True
    shaped = {v.name for v in (*graph.value_info, *graph.input, *graph.output)
              if v.type.tensor_type.HasField("shape")}
    shaped |= {t.name for t in graph.initializer}
    return any(name not in shaped for node in graph.node for name in node.output if name)


def _save_ranges(ranges: Any, path: Path) -> None:
    from onnxruntime.quantization.calibrate import save_tensors_data

    save_tensors_data(ranges, path)


def _ort_version() -> str:
    import onnxruntime

    return f"onnxruntime {onnxruntime.__version__}"


def convert_fp16(source: Path, target: Path) -> None:
    """FP16 weights and compute with the FP32 inputs and outputs kept (casts at the edges)."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    try:
        model = convert_float_to_float16(onnx.load(str(source)), keep_io_types=True)
        onnx.save(model, str(target))
    except Exception as error:
        raise EngineError(f"{source}: FP16 conversion failed: {error}") from error


def keep_fp32(source: Path, target: Path) -> None:
    """The artifact as it is: engines that convert at load (torch) take FP32 ONNX."""
    import onnx

    try:
        onnx.checker.check_model(str(source))
    except Exception as error:
        raise EngineError(f"{source}: not a valid ONNX model: {error}") from error
    shutil.copyfile(source, target)
