"""Which of an image's visual tokens a vision-language model keeps: pruning
by a score and a cap on their number. Pure numpy.

The vision stage makes `n` visual tokens an image (rows of the decoder's
hidden size); a `TokenSelection` may keep fewer, and the decoder then reads
only those (each image's `<image>` mark becomes as many image tokens as it
kept). Off by default: with neither setting every token is kept, as made.

Criterion `relative_norm` (the one there is): a token's score is its L2
norm over the largest L2 norm among the same image's tokens,

    score_i = ||t_i||_2 / max_j ||t_j||_2        (all 1 where every norm is 0)

so scores lie in [0, 1], the strongest token scores 1 whatever the scale of
the projector's output, and the score needs nothing but the stage's output
(the tokens themselves, also when they arrive made elsewhere). `prune`
keeps the tokens scoring at least `threshold` (in [0, 1): the strongest
always stays, so an image keeps at least one token); `max_visual_tokens`
then keeps at most that many, the highest scores (the earlier token on a
tie). Kept tokens stay in their original order, which is their place in
the image. Whether a setting keeps the answers is for the build's gate to
say (`engines/build/vision_language.py`), never assumed.

It must never import tiered.agent or tiered.protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tiered.errors import ConfigError

CRITERIA = ("relative_norm",)


@dataclass(frozen=True)
class Pruning:
    """Drop the tokens whose score under `criterion` is below `threshold`."""

    criterion: str = "relative_norm"
    threshold: float = 0.15

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ConfigError(f"criterion: {self.criterion!r} is not one of "
                              f"{', '.join(CRITERIA)}")
        if not 0.0 <= self.threshold < 1.0:
            raise ConfigError(f"threshold: must be within [0, 1), got {self.threshold}")


@dataclass(frozen=True)
class TokenSelection:
    """A vision stage's pruning and cap; neither set keeps every token."""

    max_visual_tokens: int | None = None  # at most this many an image, after pruning
    prune: Pruning | None = None

    def __post_init__(self) -> None:
        cap = self.max_visual_tokens
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(f"max_visual_tokens: must be an integer >= 1, got {cap!r}")

    @property
    def active(self) -> bool:
        return self.max_visual_tokens is not None or self.prune is not None

    def describe(self) -> str:
        parts = []
        if self.prune is not None:
            parts.append(f"pruned by {self.prune.criterion} < {self.prune.threshold:g}")
        if self.max_visual_tokens is not None:
            parts.append(f"at most {self.max_visual_tokens} an image")
        return ", ".join(parts) or "all kept"


def scores(tokens: np.ndarray, criterion: str = "relative_norm") -> np.ndarray:
    """Each token's score, [..., n] of `tokens` [..., n, hidden] (module docstring)."""
    if criterion not in CRITERIA:
        raise ConfigError(f"criterion: {criterion!r} is not one of {', '.join(CRITERIA)}")
    norms = np.linalg.norm(np.asarray(tokens, dtype=np.float64), axis=-1)
    largest = norms.max(axis=-1, keepdims=True)
    return np.divide(norms, largest, out=np.ones_like(norms), where=largest > 0)


def kept_indices(tokens: np.ndarray, selection: TokenSelection) -> np.ndarray:
    """The indices of one image's tokens [n, hidden] that `selection` keeps,
    ascending."""
    count = len(tokens)
    if not selection.active:
        return np.arange(count)
    score = scores(tokens, selection.prune.criterion if selection.prune else "relative_norm")
    keep = np.flatnonzero(score >= selection.prune.threshold) if selection.prune \
        else np.arange(count)
    cap = selection.max_visual_tokens
    if cap is not None and len(keep) > cap:
        # Stable: equal scores keep the earlier token.
        best = np.argsort(-score[keep], kind="stable")[:cap]
        keep = keep[np.sort(best)]
    return keep


def select(tokens: np.ndarray, selection: TokenSelection) -> list[np.ndarray]:
    """Each image's kept tokens, [kept, hidden] in original order, of
    `tokens` [images, n, hidden]."""
    return [image[kept_indices(image, selection)] for image in tokens]


def padded(per_image: Sequence[np.ndarray], hidden: int) -> np.ndarray:
    """Images' kept tokens as one FP32 [images, most kept, hidden] array: an
    image that kept fewer ends in rows of NaN (no token is NaN; the agent's
    `visual_tokens` input reads such rows as absent)."""
    most = max((len(rows) for rows in per_image), default=0)
    out = np.full((len(per_image), most, hidden), np.nan, np.float32)
    for index, rows in enumerate(per_image):
        out[index, :len(rows)] = rows
    return out


def unpadded(tokens: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """`padded`'s inverse: the rows that are tokens, [sum kept, hidden] in
    order, and each image's count. ValueError where an image has no token or
    a NaN row is followed by a token."""
    absent = np.isnan(tokens).all(axis=-1)
    counts = (tokens.shape[1] - absent.sum(axis=1)).tolist()
    tail = np.arange(tokens.shape[1])[None, :] >= np.array(counts)[:, None]
    if (absent != tail).any():
        raise ValueError("rows of NaN (absent tokens) must end an image's tokens")
    if min(counts, default=1) < 1:
        raise ValueError("an image holds no token (every row is NaN)")
    return tokens[~absent], counts
