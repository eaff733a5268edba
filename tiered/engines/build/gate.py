"""The accuracy gate and the measurements it and the report rest on: how a
build's outputs compare with the FP32 artifact's, the verdict over those
numbers, and summaries of timed runs.

All pure: arrays and numbers in, frozen values out. Missing evidence (too
few samples, no top-1 to compare) is inconclusive, never a pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiered.errors import ConfigError, EngineError


@dataclass(frozen=True)
class Agreement:
    """How a build's output compares with the FP32 artifact's on the same inputs."""

    output: str
    samples: int
    # The share of samples whose answer agrees: the argmax of a floating-point
    # output's values ("top1"), or all of an integer output's values equal
    # ("exact", a class index say). None where a floating-point output has one
    # value per sample.
    top1_agreement: float | None
    max_abs_error: float
    mean_abs_error: float
    nonfinite: int  # NaN/inf values in the build's output
    reference_accuracy: float | None = None  # with labels only
    build_accuracy: float | None = None
    method: str = "top1"  # how top1_agreement compares: "top1" or "exact"

    @property
    def accuracy_drop(self) -> float | None:
        if self.reference_accuracy is None or self.build_accuracy is None:
            return None
        return self.reference_accuracy - self.build_accuracy


def compare_outputs(
    output: str,
    reference: np.ndarray,
    candidate: np.ndarray,
    labels: np.ndarray | None = None,
) -> Agreement:
    """Top-1 agreement, absolute errors and (with labels) accuracy of both.

    Samples run along axis 0; top-1 is the argmax over each sample's values.
    An integer (or boolean) output agrees where all its values are equal,
    and, holding one value a sample, is that sample's class.
    """
    if reference.shape != candidate.shape:
        raise EngineError(
            f"output {output!r}: the build answers shape {list(candidate.shape)}, "
            f"the FP32 artifact {list(reference.shape)}"
        )
    samples = reference.shape[0] if reference.ndim else 1
    ref = reference.reshape(samples, -1).astype(np.float64)
    got = candidate.reshape(samples, -1).astype(np.float64)
    finite = np.isfinite(got)
    error = np.abs(ref - got)[finite]
    top1 = None
    build_accuracy = reference_accuracy = None
    exact = reference.dtype.kind in "iub"
    ref_top = got_top = None  # each sample's class, where the output names one
    if exact and samples:
        equal = reference.reshape(samples, -1) == candidate.reshape(samples, -1)
        top1 = float(np.mean(np.all(equal, axis=1)))
        if ref.shape[1] == 1:
            ref_top, got_top = ref[:, 0], got[:, 0]
    elif ref.shape[1] > 1 and samples:
        ref_top = ref.argmax(axis=1)
        got_top = np.where(finite, got, -np.inf).argmax(axis=1)
        top1 = float(np.mean(ref_top == got_top))
    if labels is not None and ref_top is not None and got_top is not None:
        labels = np.asarray(labels).reshape(-1)
        if labels.shape[0] != samples:
            raise ConfigError(f"labels: {labels.shape[0]} labels for {samples} eval samples")
        reference_accuracy = float(np.mean(ref_top == labels))
        build_accuracy = float(np.mean(got_top == labels))
    return Agreement(
        output=output,
        samples=int(samples),
        top1_agreement=top1,
        max_abs_error=float(error.max()) if error.size else 0.0,
        mean_abs_error=float(error.mean()) if error.size else 0.0,
        nonfinite=int(finite.size - finite.sum()),
        reference_accuracy=reference_accuracy,
        build_accuracy=build_accuracy,
        method="exact" if exact else "top1",
    )


@dataclass(frozen=True)
class GateDecision:
    """The accuracy gate's verdict and the numbers it used.

    verdict: "pass", "fail" or "inconclusive" (too few samples, or no top-1 to
    compare: never a pass). `accepted` is whether the version may be written:
    a pass, or anything the user let through with --allow-accuracy-drop.
    """

    verdict: str
    accepted: bool
    reason: str


def judge(
    agreement: Agreement,
    *,
    min_agreement: float,
    min_samples: int,
    max_accuracy_drop: float | None = None,
    allow_accuracy_drop: bool = False,
) -> GateDecision:
    verdict, why, numbers = _judge_output(agreement, min_agreement, min_samples,
                                          max_accuracy_drop)
    return _decide(verdict, why, numbers, allow_accuracy_drop)


# Worst first: one output's failure fails the whole, missing evidence holds it.
VERDICT_ORDER = ("fail", "inconclusive", "pass")


def judge_outputs(
    agreements: Sequence[Agreement],
    *,
    min_agreement: float,
    min_samples: int,
    max_accuracy_drop: float | None = None,
    allow_accuracy_drop: bool = False,
) -> GateDecision:
    """One verdict over several outputs (an ensemble's): the worst verdict of
    the outputs with an agreement figure. A floating-point output with one
    value a sample has none: its errors are reported, and it is judged only
    where no output has a figure (then inconclusive)."""
    if not agreements:
        raise ValueError("judge_outputs: no outputs to judge")
    judged = [a for a in agreements if a.top1_agreement is not None] or list(agreements)
    verdicts = [_judge_output(a, min_agreement, min_samples, max_accuracy_drop)
                for a in judged]
    worst = min(verdicts, key=lambda v: VERDICT_ORDER.index(v[0]))[0]
    why = "; ".join(f"{a.output!r}: {v[1]}" for a, v in zip(judged, verdicts, strict=True)
                    if v[0] == worst)
    reported = [f"{a.output!r}: max abs error {a.max_abs_error:.4g}, mean "
                f"{a.mean_abs_error:.4g} (not gated: one value per sample)"
                for a in agreements if a not in judged]
    numbers = " | ".join([v[2] for v in verdicts] + reported)
    return _decide(worst, why, numbers, allow_accuracy_drop)


def _judge_output(a: Agreement, min_agreement: float, min_samples: int,
                  max_accuracy_drop: float | None) -> tuple[str, str, str]:
    """(verdict, why, the numbers) of one output."""
    kind = "exact" if a.method == "exact" else "top-1"
    numbers = (
        f"{kind} agreement {_fmt(a.top1_agreement)} (threshold {min_agreement:.4f}) over "
        f"{a.samples} samples of {a.output!r}; max abs error {a.max_abs_error:.4g}, "
        f"mean {a.mean_abs_error:.4g}"
    )
    if a.accuracy_drop is not None:
        numbers += (f"; accuracy FP32 {a.reference_accuracy:.4f}, build {a.build_accuracy:.4f}"
                    f" (drop {a.accuracy_drop:+.4f})")
    if a.samples < min_samples:
        verdict, why = "inconclusive", f"only {a.samples} samples (the gate needs {min_samples})"
    elif a.top1_agreement is None:
        verdict, why = "inconclusive", "the output has one value per sample, so no top-1 to compare"
    elif a.nonfinite:
        verdict, why = "fail", f"{a.nonfinite} NaN/inf values in the build's output"
    elif a.top1_agreement < min_agreement:
        verdict, why = "fail", f"{kind} agreement below the threshold"
    elif (max_accuracy_drop is not None and a.accuracy_drop is not None
          and a.accuracy_drop > max_accuracy_drop):
        verdict, why = "fail", f"accuracy drops more than {max_accuracy_drop:.4f}"
    else:
        verdict, why = "pass", "within the threshold"
    return verdict, why, numbers


def judge_answers(answers: AnswerMatch, min_answer_match: float, min_questions: int,
                  allow_accuracy_drop: bool = False, kept: TokensKept | None = None
                  ) -> GateDecision:
    """A whole vision-language build's verdict: the built stages' greedy
    answers against the FP32 model's, token for token (the built decoder fed
    only the kept visual tokens where pruning or a cap is set: `kept`)."""
    numbers = (f"answer match {_fmt(answers.match)} (threshold {min_answer_match:.4f}) over "
               f"{answers.questions} questions, {answers.max_new_tokens} tokens each")
    if kept is not None:
        numbers += f"; {kept.describe()}"
    if answers.questions < min_questions or answers.match is None:
        verdict, why = "inconclusive", (f"only {answers.questions} questions (the gate needs "
                                        f"{min_questions})")
    elif answers.match < min_answer_match:
        verdict, why = "fail", "the built stages answer unlike the FP32 model" + (
            "" if kept is None else
            f" with the visual tokens {kept.selection} (the pruning or cap drops answers: "
            "lower the prune threshold or raise max_visual_tokens)")
    else:
        verdict, why = "pass", "the built stages answer as the FP32 model"
    return _decide(verdict, why, numbers, allow_accuracy_drop)


def _decide(verdict: str, why: str, numbers: str, allow_accuracy_drop: bool) -> GateDecision:
    accepted = verdict == "pass" or allow_accuracy_drop
    if verdict != "pass" and allow_accuracy_drop:
        why += "; accepted anyway (--allow-accuracy-drop)"
    return GateDecision(verdict, accepted, f"{verdict}: {why}: {numbers}")


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


@dataclass(frozen=True)
class LatencySummary:
    """Wall time of `engine.run` for one batch size, in milliseconds."""

    batch_size: int
    runs: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float
    items_per_s: float  # batch_size / mean: sustained rate, outliers included


def summarize_latency(batch_size: int, seconds: Sequence[float]) -> LatencySummary:
    """Nearest-rank percentiles of the timed runs."""
    if not seconds:
        raise ValueError("summarize_latency: no timed runs")
    ordered = sorted(seconds)

    def rank(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3

    mean = sum(ordered) / len(ordered)
    return LatencySummary(
        batch_size=batch_size,
        runs=len(ordered),
        mean_ms=mean * 1e3,
        p50_ms=rank(0.50),
        p90_ms=rank(0.90),
        min_ms=ordered[0] * 1e3,
        max_ms=ordered[-1] * 1e3,
        items_per_s=batch_size / mean if mean > 0 else math.inf,
    )


@dataclass(frozen=True)
class GenerationAgreement:
    """How a generative build's greedy tokens compare with the FP32 reference's
    over the eval prompts (tiered.engines.build.spec.GenerativeBuildSettings
    says what each figure means)."""

    prompts: int
    first_tokens: int  # N of the first-N match
    first_tokens_match: float | None  # share of prompts; None without prompts
    token_agreement: float | None  # teacher-forced top-1, over `positions`
    positions: int
    nonfinite: int  # NaN/inf logits of the build while teacher-forced
    mismatched: tuple[int, ...]  # indices of the prompts whose first N tokens differ


def compare_generations(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]],
    forced_top1: Sequence[Sequence[int]], first_tokens: int, nonfinite: int = 0,
) -> GenerationAgreement:
    """`reference` and `candidate`: each prompt's greedy tokens; `forced_top1`:
    the build's top-1 at each of the reference's positions, fed the reference's
    tokens (teacher forcing)."""
    if not len(reference) == len(candidate) == len(forced_top1):
        raise EngineError(f"compare_generations: {len(reference)} reference, "
                          f"{len(candidate)} candidate, {len(forced_top1)} forced rows")
    mismatched = []
    agree = positions = 0
    for index, (ref, got, forced) in enumerate(zip(reference, candidate, forced_top1,
                                                   strict=True)):
        if len(forced) != len(ref):
            raise EngineError(f"compare_generations: prompt {index}: {len(forced)} forced "
                              f"positions for {len(ref)} reference tokens")
        if list(got[:first_tokens]) != list(ref[:first_tokens]):
            mismatched.append(index)
        agree += sum(int(a == b) for a, b in zip(ref, forced, strict=True))
        positions += len(ref)
    prompts = len(reference)
    return GenerationAgreement(
        prompts=prompts, first_tokens=first_tokens,
        first_tokens_match=(prompts - len(mismatched)) / prompts if prompts else None,
        token_agreement=agree / positions if positions else None,
        positions=positions, nonfinite=nonfinite, mismatched=tuple(mismatched))


def judge_generations(
    agreement: GenerationAgreement, *, min_first_tokens_match: float,
    min_token_agreement: float, min_prompts: int, allow_accuracy_drop: bool = False,
) -> GateDecision:
    a = agreement
    numbers = (f"first-{a.first_tokens}-token match {_fmt(a.first_tokens_match)} (threshold "
               f"{min_first_tokens_match:.4f}), teacher-forced top-1 agreement "
               f"{_fmt(a.token_agreement)} (threshold {min_token_agreement:.4f}) over "
               f"{a.prompts} prompts, {a.positions} tokens")
    if a.prompts < min_prompts:
        verdict, why = "inconclusive", f"only {a.prompts} prompts (the gate needs {min_prompts})"
    elif a.first_tokens_match is None or a.token_agreement is None:
        verdict, why = "inconclusive", "the reference generated no tokens to compare"
    elif a.nonfinite:
        verdict, why = "fail", f"{a.nonfinite} NaN/inf logits from the build"
    elif a.first_tokens_match < min_first_tokens_match:
        verdict, why = "fail", f"first-{a.first_tokens}-token match below the threshold"
    elif a.token_agreement < min_token_agreement:
        verdict, why = "fail", "token agreement below the threshold"
    else:
        verdict, why = "pass", "within the thresholds"
    accepted = verdict == "pass" or allow_accuracy_drop
    if verdict != "pass" and allow_accuracy_drop:
        why += "; accepted anyway (--allow-accuracy-drop)"
    return GateDecision(verdict, accepted, f"{verdict}: {why}: {numbers}")


@dataclass(frozen=True)
class VisualAgreement:
    """How a built vision stage's visual tokens compare with the FP32 export's
    on the same images (tiered.engines.build.spec.VisionBuildSettings says
    what each figure means). None where there are no tokens."""

    images: int
    tokens: int  # visual tokens compared, over every image
    cosine_mean: float | None
    cosine_p1: float | None  # 1st percentile (nearest rank) of the per-token cosine
    cosine_min: float | None
    relative_l2: float | None
    max_abs_error: float
    nonfinite: int  # NaN/inf values in the build's tokens


def compare_visual_tokens(reference: np.ndarray, candidate: np.ndarray) -> VisualAgreement:
    """`reference`, `candidate`: [images, tokens, hidden]. A token whose two
    vectors are both zero agrees (cosine 1); one zero against one not, 0;
    a token holding NaN/inf, -1 (the worst)."""
    if reference.shape != candidate.shape or reference.ndim != 3:
        raise EngineError(f"visual tokens: the build answers shape {list(candidate.shape)}, "
                          f"the FP32 export {list(reference.shape)} ([images, tokens, hidden])")
    ref = reference.reshape(-1, reference.shape[-1]).astype(np.float64)
    got = candidate.reshape(-1, candidate.shape[-1]).astype(np.float64)
    finite_rows = np.isfinite(got).all(axis=1)
    got_clean = np.where(np.isfinite(got), got, 0.0)
    ref_norm = np.linalg.norm(ref, axis=1)
    got_norm = np.linalg.norm(got_clean, axis=1)
    both_zero = (ref_norm == 0) & (got_norm == 0)
    denominator = np.where(ref_norm * got_norm > 0, ref_norm * got_norm, 1.0)
    cosine = np.where(both_zero, 1.0, np.sum(ref * got_clean, axis=1) / denominator)
    cosine = np.where(finite_rows, cosine, -1.0)
    error = np.abs(ref - got)[np.isfinite(got)]
    total = float(np.linalg.norm(ref))
    tokens = cosine.shape[0]
    ordered = np.sort(cosine)
    return VisualAgreement(
        images=int(reference.shape[0]), tokens=int(tokens),
        cosine_mean=float(cosine.mean()) if tokens else None,
        cosine_p1=float(ordered[max(0, math.ceil(0.01 * tokens) - 1)]) if tokens else None,
        cosine_min=float(ordered[0]) if tokens else None,
        relative_l2=(float(np.linalg.norm(ref - got_clean)) / total if total > 0 else
                     float(np.linalg.norm(got_clean) > 0)) if tokens else None,
        max_abs_error=float(error.max()) if error.size else 0.0,
        nonfinite=int(np.size(got) - np.isfinite(got).sum()),
    )


@dataclass(frozen=True)
class AnswerMatch:
    """Greedy answers fed the built stage's visual tokens against those fed the
    FP32 stage's, one question an image."""

    questions: int
    match: float | None  # share of questions answered token for token alike; None without any
    max_new_tokens: int
    mismatched: tuple[int, ...]  # indices of the questions answered differently
    # Teacher-forced on the reference's answers: the share of answer positions
    # where the build's top-1 is the reference's token (reported, not gated:
    # it says how far apart differing answers are).
    token_agreement: float | None = None
    positions: int = 0


def compare_answers(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]],
                    max_new_tokens: int,
                    forced_top1: Sequence[Sequence[int]] | None = None) -> AnswerMatch:
    if len(reference) != len(candidate) or (forced_top1 is not None
                                            and len(forced_top1) != len(reference)):
        raise EngineError(f"compare_answers: {len(reference)} reference answers, "
                          f"{len(candidate)} candidate answers")
    mismatched = tuple(index for index, (ref, got) in enumerate(zip(reference, candidate,
                                                                    strict=True))
                       if list(ref) != list(got))
    questions = len(reference)
    agree = positions = 0
    for ref, forced in zip(reference, forced_top1 or (), strict=False):
        if len(forced) != len(ref):
            raise EngineError(f"compare_answers: {len(forced)} forced positions for "
                              f"{len(ref)} reference tokens")
        agree += sum(int(a == b) for a, b in zip(ref, forced, strict=True))
        positions += len(ref)
    return AnswerMatch(questions, (questions - len(mismatched)) / questions if questions else None,
                       max_new_tokens, mismatched,
                       agree / positions if positions else None, positions)


@dataclass(frozen=True)
class TokensKept:
    """What a vision stage's pruning and cap kept of the eval images' visual
    tokens (engines/visual_tokens.py)."""

    selection: str  # the settings, in words
    tokens_per_image: int  # what the stage makes
    images: int
    mean_kept: float  # per image
    min_kept: int
    max_kept: int

    @classmethod
    def of(cls, selection: str, tokens_per_image: int, counts: Sequence[int]) -> TokensKept:
        return cls(selection, tokens_per_image, len(counts),
                   float(np.mean(counts)) if len(counts) else 0.0,
                   min(counts, default=0), max(counts, default=0))

    def describe(self) -> str:
        return (f"visual tokens {self.selection}: {self.mean_kept:.2f} of "
                f"{self.tokens_per_image} kept an image on average (min {self.min_kept}, max "
                f"{self.max_kept})")


def judge_visual(
    agreement: VisualAgreement, answers: AnswerMatch | None, *, min_cosine_mean: float,
    min_cosine_p1: float, max_relative_l2: float, min_answer_match: float, min_images: int,
    allow_accuracy_drop: bool = False, kept: TokensKept | None = None,
) -> GateDecision:
    """The vision stage's verdict: every token figure within its threshold, and
    the answer match where it was measured (`answers` None: no questions or
    no decoder, said in the reason; the token figures decide alone). With
    pruning or a cap (`kept`), the answers are those from the kept tokens,
    and without answers the gate cannot judge them: inconclusive."""
    a = agreement
    numbers = (f"visual-token cosine mean {_fmt(a.cosine_mean)} (threshold "
               f"{min_cosine_mean:.4f}), 1st percentile {_fmt(a.cosine_p1)} (threshold "
               f"{min_cosine_p1:.4f}), min {_fmt(a.cosine_min)}, relative L2 error "
               f"{_fmt(a.relative_l2)} (at most {max_relative_l2:.4f}) over {a.images} images, "
               f"{a.tokens} tokens")
    if answers is None:
        numbers += "; answer match not measured (no questions in the eval data)"
    else:
        numbers += (f"; answer match {_fmt(answers.match)} (threshold {min_answer_match:.4f}) "
                    f"over {answers.questions} questions, {answers.max_new_tokens} tokens each "
                    f"(teacher-forced token agreement {_fmt(answers.token_agreement)})")
    if kept is not None:
        numbers += f"; {kept.describe()}"
    if a.images < min_images:
        verdict, why = "inconclusive", f"only {a.images} images (the gate needs {min_images})"
    elif a.cosine_mean is None or a.cosine_p1 is None or a.relative_l2 is None:
        verdict, why = "inconclusive", "the stage gave no visual tokens to compare"
    elif answers is not None and answers.match is None:
        verdict, why = "inconclusive", "no answers to compare"
    elif kept is not None and answers is None:
        verdict, why = "inconclusive", ("visual-token pruning or a cap is set, and only "
                                        "answers can judge it: give eval data with questions")
    elif a.nonfinite:
        verdict, why = "fail", f"{a.nonfinite} NaN/inf values in the build's visual tokens"
    elif a.cosine_mean < min_cosine_mean:
        verdict, why = "fail", "visual-token cosine mean below the threshold"
    elif a.cosine_p1 < min_cosine_p1:
        verdict, why = "fail", "visual-token cosine 1st percentile below the threshold"
    elif a.relative_l2 > max_relative_l2:
        verdict, why = "fail", "visual-token relative L2 error above the threshold"
    elif answers is not None and answers.match is not None and answers.match < min_answer_match:
        verdict, why = "fail", "answer match below the threshold" + (
            "" if kept is None else
            f" with the visual tokens {kept.selection} (the pruning or cap drops answers: "
            "lower the prune threshold or raise max_visual_tokens)")
    else:
        verdict, why = "pass", "within the thresholds"
    return _decide(verdict, why, numbers, allow_accuracy_drop)
