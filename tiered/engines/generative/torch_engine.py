"""The datacenter's generative engine: a Llama checkpoint (config.json,
*.safetensors, tokenizer.json) run by our own forward in torch, with a static
KV cache and one batched decode step for every running sequence.

The forward follows Llama's architecture: token embedding; per layer
RMSNorm, grouped-query attention with rotary position embedding (rotate-half
form, angles in FP32), a residual, RMSNorm and a SwiGLU MLP, a residual; a
final RMSNorm and lm_head. Few kernels a layer, since a small model's decode
is bound by them: q, k and v in one projection, gate and up in another,
fused RMSNorm and attention kernels, and rotary in three.

The KV cache is preallocated: one slot of `max_context` positions per
sequence that may run (`max_sequences`), plus one scratch slot that
teacher-forced scoring writes into. The sequences new at a step are
prefilled together (their prompts padded to the longest, in one forward; on
CUDA to few shapes, rows to a decode bucket and the length to a power of
two, since a shape not met before costs tens of milliseconds); every
sequence already prefilled advances in one batched decode forward, so
sequences join and leave between steps (in-flight batching). Stale keys a
slot's previous sequence left are never read: a query attends only to
positions up to its own.

Decode has static shapes on CUDA, so it is captured as CUDA graphs and
replayed: one graph for each bucket of `cuda_graph_batch_sizes` slots and
each window of positions (a power of two from 64, up to the cache's length).
A bucket is the first slots of the cache, one row a slot, whose keys and
values attention reads in place over the window (no gather); a new sequence
takes the lowest free slot, so the running ones stay in the smallest bucket,
and short sequences read a short window. Rows of idle slots write at their
position 0, which a sequence's prefill, after the decode of its step, writes
over. A prefill is padded to few shapes (rows to a bucket, the length to a
power of two), since each new shape costs tens of milliseconds; one of at
most `PREFILL_GRAPH_POSITIONS` is a CUDA graph of its shape too, so that
sequences joining a few at a time hold the running ones' next step for
little more than their own compute. The layers of the graphs and of
prefill are one function compiled by torch.compile (fused elementwise
kernels; a one-row matmul becomes a tuned reduction), eager where it cannot
compile. The engine captures every graph a step may replay as it loads:
a capture meets the compiler's new shapes (and tunes their kernels, up to
seconds, which every running sequence would wait for), and its warm-up
runs write the first slots' position 0, which only an empty cache may
take. On the CPU the batch is
the running sequences' slots, gathered, and attention reads only the
positions written so far.

A vision-language decoder (a checkpoint with `visual.json`) takes visual
tokens with a prompt: prefill replaces the embeddings of the prompt's image
tokens with them, before the first layer (so the CUDA path's compiled layers
are the same); decode reads token ids only.

Never imports the agent or the wire protocol: token ids and text in, tokens out.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiered import names
from tiered.engines.generative import is_checkpoint
from tiered.engines.generative.base import GenerativeEngine, Sampling, Token, pick
from tiered.engines.generative.text import CheckpointTokenizer
from tiered.engines.generative.visual import VisualFacts, visual_rows
from tiered.errors import ConfigError, InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {names.Precision.FP32: torch.float32, names.Precision.FP16: torch.float16,
          names.Precision.BF16: torch.bfloat16}
# fp8: the linear layers' weights in FP8 E4M3 with a scale per output channel,
# the rest (embeddings, norms, lm_head, KV cache, activations) in FP16 on CUDA
# (FP32 on the CPU, where FP8 only checks the numerics: no FP8 matmul is faster).
PRECISIONS = (*DTYPES, names.Precision.FP8)
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
RECOMPILE_LIMIT = 32  # the layer's compiles: about 8 seen (prefill, decode, one row)
# A prefill of at most this many positions (rows x length, padded) replays a
# CUDA graph of its shape: a small prefill is its kernels' launches, which
# the running sequences' next step waits for. Larger ones run the compiled
# layers as they are (their launches are a small part of their time).
PREFILL_GRAPH_POSITIONS = 2048


@dataclass(frozen=True)
class TorchGenerativeSettings:
    """How the torch engine runs a checkpoint (a model's config.yaml `engine:`)."""

    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    precision: str = "fp16"  # fp32 | fp16 | bf16 | fp8; on the CPU fp32, bf16 or fp8
    max_sequences: int = 16  # KV cache slots: sequences that may run at once
    max_context: int = 0  # positions per slot; 0: the model's max_position_embeddings
    max_cache_mib: int = 4096  # refuse a KV cache larger than this
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # decode buckets (CUDA)
    cuda_graphs: bool = True  # capture each bucket's decode once (CUDA only)
    compile: bool = True  # layers through torch.compile (CUDA, with cuda_graphs)
    threads: int = 0  # torch intra-op threads on the CPU; 0 leaves torch's default

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision: {self.precision!r} is not one of "
                              f"{', '.join(PRECISIONS)}")
        for name in ("max_sequences", "max_cache_mib"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_context < 0 or self.threads < 0:
            raise ConfigError("max_context, threads: must be >= 0")
        if any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise ConfigError("cuda_graph_batch_sizes: sizes must be >= 1")


@dataclass(frozen=True)
class LlamaShape:
    """What the forward needs from config.json."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    max_positions: int
    eos: frozenset[int]

    @classmethod
    def read(cls, config: Mapping[str, Any], where: str) -> LlamaShape:
        if config.get("model_type") != "llama":
            raise ConfigError(f"{where}: model_type {config.get('model_type')!r}; this engine "
                              "runs Llama checkpoints (model_type 'llama')")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ConfigError(f"{where}: rope type {rope.get('rope_type')!r} is not supported "
                              "(only the default rotary embedding)")
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act {config['hidden_act']!r}; expected silu")
        try:
            heads = int(config["num_attention_heads"])
            eos = config.get("eos_token_id")
            return cls(
                vocab=int(config["vocab_size"]), hidden=int(config["hidden_size"]),
                layers=int(config["num_hidden_layers"]), heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
                rms_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                max_positions=int(config.get("max_position_embeddings", 2048)),
                eos=frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ConfigError(f"{where}: {error!r} missing or malformed") from error


class _Sequence:
    __slots__ = ("slot", "prompt", "visual", "length", "next_input", "sampling", "generated",
                 "rng")

    def __init__(self, slot: int, prompt: list[int], sampling: Sampling,
                 visual: np.ndarray | None = None) -> None:
        self.slot = slot
        self.prompt: list[int] | None = prompt  # until prefilled
        self.visual = visual  # the rows of its image tokens, until prefilled
        self.length = 0  # positions of the cache written
        self.next_input = 0  # the token the next decode reads
        self.sampling = sampling
        self.generated = 0
        self.rng = np.random.default_rng(sampling.seed)


class TorchGenerativeEngine(GenerativeEngine):
    def __init__(self, checkpoint: Path, settings: TorchGenerativeSettings) -> None:
        checkpoint = Path(checkpoint)
        if not is_checkpoint(checkpoint):
            raise ConfigError(f"{checkpoint}: not a checkpoint directory (config.json, "
                              "tokenizer.json and *.safetensors)")
        self.settings = settings
        self.device = _device(settings.device)
        if self.device == "cpu" and settings.precision == names.Precision.FP16:
            raise ConfigError("precision: fp16 runs on CUDA only; on the CPU use fp32 or bf16")
        if self.device == "cpu" and settings.threads:
            torch.set_num_threads(settings.threads)
        fp8 = settings.precision == names.Precision.FP8
        if fp8 and self.device == "cuda" and not has_fp8_tensor_cores():
            raise ConfigError("precision: fp8 needs FP8 tensor cores (compute capability 8.9 "
                              "or newer); this GPU has "
                              f"{'.'.join(map(str, torch.cuda.get_device_capability()))}")
        self.precision = settings.precision
        self.dtype = ((torch.float16 if self.device == "cuda" else torch.float32) if fp8
                      else DTYPES[settings.precision])
        config = _read_json(checkpoint / "config.json")
        self.shape = shape = LlamaShape.read(config, f"{checkpoint}/config.json")
        self.visual_facts = VisualFacts.read(checkpoint)
        if self.visual_facts is not None and self.visual_facts.hidden_size != shape.hidden:
            raise ConfigError(f"{checkpoint}/visual.json: hidden_size "
                              f"{self.visual_facts.hidden_size}; config.json's is {shape.hidden}")
        self.max_context = settings.max_context or shape.max_positions
        if self.max_context > shape.max_positions:
            raise ConfigError(f"max_context: {self.max_context} exceeds the model's "
                              f"max_position_embeddings {shape.max_positions}")
        self.max_sequences = settings.max_sequences
        self._tokenizer = CheckpointTokenizer(checkpoint)
        self._weights = _load_weights(checkpoint, shape, self.dtype, self.device, fp8)
        self.weight_bytes = sum(  # what the GPU holds (a decode reads all but the embedding)
            t.numel() * t.element_size() for t in _tensors(self._weights))
        slots = self.max_sequences + 1  # the last is scratch
        cache_bytes = (2 * shape.layers * slots * shape.kv_heads * self.max_context
                       * shape.head_dim * torch.finfo(self.dtype).bits // 8)
        if cache_bytes > settings.max_cache_mib << 20:
            raise ConfigError(
                f"max_cache_mib: a KV cache of {self.max_sequences} sequences x "
                f"{self.max_context} positions takes {cache_bytes >> 20} MiB, more than "
                f"{settings.max_cache_mib}; lower max_sequences or max_context")
        cache_shape = (shape.layers, slots, shape.kv_heads, self.max_context, shape.head_dim)
        self._keys = torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
        self._values = torch.zeros(cache_shape, dtype=self.dtype, device=self.device)
        self.cache_bytes = cache_bytes
        half = torch.arange(0, shape.head_dim, 2, dtype=torch.int64, device=self.device)
        self._inv_freq = 1.0 / (shape.rope_theta ** (half.float() / shape.head_dim))
        self._positions = torch.arange(self.max_context, device=self.device)
        self._free = list(range(self.max_sequences))  # a heap: the lowest is taken
        self._sequences: dict[int, _Sequence] = {}
        self._ids = itertools.count(1)
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}  # (bucket, window)
        self._prefill_graphs: dict[tuple[int, int], _PrefillGraph] = {}  # (rows, length)
        self._use_graphs = self.device == "cuda" and settings.cuda_graphs
        # A bucket is a number of slots: none beyond the cache's.
        self._buckets = sorted({min(b, self.max_sequences)
                                for b in settings.cuda_graph_batch_sizes})
        # A graph attends over a window of positions, a power of two from 64
        # (the cache's length at most): short sequences read a short window.
        self._windows = sorted({min(self.max_context, 64 << i)
                                for i in range(self.max_context.bit_length())})
        self._layer = _layer_of(shape)
        self._compiled_layers: dict[bool, Any] = {}  # one row or not: the layer compiled
        self._compile = self._use_graphs and settings.compile
        self._graph_pool: Any = None  # one memory pool the graphs share
        if self._use_graphs:
            self._capture_all()

    def _capture_all(self) -> None:
        """Capture every graph a step may replay (see the module's note):
        each bucket's decode over each window, and each prefill shape of at
        most PREFILL_GRAPH_POSITIONS, compiling the layers as they come."""
        started = time.perf_counter()
        for bucket in self._buckets:
            for window in self._windows:
                self._graphs[bucket, window] = self._capture(
                    lambda layer_of, b=bucket, w=window: _DecodeGraph(self, b, w, layer_of),
                    bucket == 1)
        for rows, length in prefill_shapes(self._buckets, self.max_context):
            self._prefill_graphs[rows, length] = self._capture(
                lambda layer_of, r=rows, n=length: _PrefillGraph(self, r, n, layer_of))
        log.info("captured %d decode and %d prefill CUDA graphs in %.1f s%s",
                 len(self._graphs), len(self._prefill_graphs), time.perf_counter() - started,
                 ", the layers compiled" if self._compile else "")

    # -- the interface -------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids)

    def start(self, prompt: Sequence[int], sampling: Sampling,
              visual: np.ndarray | None = None) -> int:
        self.check_fits(prompt, sampling)
        bad = [t for t in prompt if not 0 <= t < self.shape.vocab]
        if bad:
            raise InvalidArgument(f"text_input: token id {bad[0]} is outside the "
                                  f"vocabulary of {self.shape.vocab}")
        rows = visual_rows(prompt, visual, self.visual_facts)
        if not self._free:  # check_fits counted running sequences; slots agree
            raise ResourceExhausted(f"all {self.max_sequences} sequences are running")
        sequence = next(self._ids)
        self._sequences[sequence] = _Sequence(heapq.heappop(self._free), list(prompt), sampling,
                                              rows)
        return sequence

    def step(self) -> list[Token]:
        new = [(i, s) for i, s in self._sequences.items() if s.prompt is not None]
        old = [(i, s) for i, s in self._sequences.items() if s.prompt is None]
        picks: list[tuple[int, float]] = []
        with torch.inference_mode():
            for batch, forward in ((old, self._decode), (new, self._prefill)):
                if batch:  # decode first: prefill writes over idle rows' writes
                    states = [s for _, s in batch]
                    picks += self._pick(*forward(states), states)
        tokens = []
        for (sequence, state), (token, logprob) in zip([*old, *new], picks, strict=True):
            state.generated += 1
            state.next_input = token
            last = (token in self.shape.eos or state.generated >= state.sampling.max_tokens
                    or state.length >= self.max_context)
            if last:
                self.stop(sequence)
            tokens.append(Token(sequence, token, logprob, last))
        return tokens

    def stop(self, sequence: int) -> None:
        state = self._sequences.pop(sequence, None)
        if state is not None:
            heapq.heappush(self._free, state.slot)

    @property
    def running(self) -> int:
        return len(self._sequences)

    def describe(self) -> dict[str, str]:
        return {"engine": "torch", "device": self.device, "precision": self.precision,
                "context": str(self.max_context), "sequences": str(self.max_sequences),
                "weights_mib": f"{self.weight_bytes / (1 << 20):.1f}",
                "kv_cache_mib": f"{self.cache_bytes / (1 << 20):.1f}",
                "cuda_graphs": str(self._use_graphs).lower(),
                "compiled": str(self._compile).lower(),
                **({} if self.visual_facts is None else
                   {"visual_tokens_per_image": str(self.visual_facts.tokens_per_image)})}

    def close(self) -> None:
        self._sequences.clear()
        self._graphs.clear()
        self._prefill_graphs.clear()

    def prefix_logits(self, ids: Sequence[int], visual: np.ndarray | None = None
                      ) -> np.ndarray:
        """Logits after each prefix of `ids` (teacher forcing, `visual` at its
        image tokens), FP32 [len, vocab]; written into the scratch slot, so
        running sequences are untouched."""
        if not ids or len(ids) > self.max_context:
            raise InvalidArgument(f"ids: 1..{self.max_context} tokens, got {len(ids)}")
        rows = visual_rows(ids, visual, self.visual_facts)
        with torch.inference_mode():
            tokens = torch.tensor([list(ids)], device=self.device)
            positions = self._positions[:len(ids)].unsqueeze(0)
            slots = torch.tensor([self.max_sequences], device=self.device)
            hidden = self._forward(tokens, positions, slots, len(ids),
                                   visual=self._visual_at(tokens, [len(ids)], [rows]))
            return self._head(hidden[0]).float().cpu().numpy()

    # -- the forward ---------------------------------------------------------

    def _prefill(self, states: list[_Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The logits after each of `states`' prompts, in one forward. Shorter
        prompts are padded: the pads' cache writes lie past the prompt, where
        each decode writes before any query reads. On CUDA the batch is padded
        to a decode bucket (rows of no sequence, written to the scratch slot)
        and the length to `prefill_length`: a shape the forward has not met
        costs tens of milliseconds of CPU, so joining sequences, a few at a
        time, must meet few shapes; a small one replays its shape's CUDA graph."""
        prompts = [s.prompt or [] for s in states]
        lengths = [len(prompt) for prompt in prompts]
        longest, rows = max(lengths), len(states)
        if self.device == "cuda":
            longest = prefill_length(longest, self.max_context)
            rows = next((b for b in self._buckets if b >= rows), rows)
        pad = rows - len(states)  # rows of no sequence
        tokens = torch.tensor([[*prompt, *[0] * (longest - len(prompt))] for prompt in prompts]
                              + [[0] * longest] * pad, device=self.device)
        slots = torch.tensor([s.slot for s in states] + [self.max_sequences] * pad,
                             device=self.device)
        visual = self._visual_at(tokens, lengths + [0] * pad,
                                 [s.visual for s in states] + [None] * pad)
        graph = self._prefill_graphs.get((rows, longest)) if visual is None else None
        if graph is not None:
            logits, greedy = graph.run(tokens, slots, [n - 1 for n in lengths] + [0] * pad,
                                       len(states))
        else:
            positions = self._positions[:longest].expand(rows, longest)
            compiled = self._compiled()
            try:  # compiled: far fewer launches, the step's other sequences wait less
                hidden = self._forward(tokens, positions, slots, longest, compiled, visual)
            except Exception as error:
                if compiled is None:
                    raise
                self._compile_failed(error)  # the writes are the same: run it again eager
                hidden = self._forward(tokens, positions, slots, longest, visual=visual)
            ends = torch.tensor(lengths, device=self.device) - 1
            logits = self._head(hidden[torch.arange(len(states), device=self.device), ends])
            greedy = None
        for state, length in zip(states, lengths, strict=True):
            state.prompt, state.length, state.visual = None, length, None
        return logits, greedy

    def _visual_at(self, tokens: torch.Tensor, lengths: list[int],
                   visual: list[np.ndarray | None]) -> _Visual | None:
        """Where the prompts `tokens` [B, T] (each of `lengths`, padded past
        it) take visual tokens, and the rows, in the order of the positions
        (row-major); None where none does. `visual` is each prompt's rows,
        checked to be as many as its image tokens."""
        if self.visual_facts is None or all(rows is None for rows in visual):
            return None
        within = self._positions[:tokens.shape[1]] < torch.tensor(
            lengths, device=self.device)[:, None]
        at = (tokens == self.visual_facts.image_token_index) & within
        rows = torch.from_numpy(np.concatenate([r for r in visual if r is not None]))
        return _Visual(at, rows.to(device=self.device, dtype=self.dtype))

    def _decode(self, states: list[_Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token's logits for each of `states`, in one forward, and their
        greedy picks where a graph made them; each sequence's cache grows by
        its last token."""
        tokens = [s.next_input for s in states]
        positions = [s.length for s in states]
        slots = [s.slot for s in states]
        for s in states:
            s.length += 1
        rows = 1 + max(slots)  # the graphs' rows are the first slots
        bucket = next((b for b in self._buckets if b >= rows), None) \
            if self._use_graphs else None
        if bucket is None:  # eager (beyond the largest bucket too): read what is written
            return self._head(self._forward(
                torch.tensor(tokens, device=self.device).unsqueeze(1),
                torch.tensor(positions, device=self.device).unsqueeze(1),
                torch.tensor(slots, device=self.device), max(positions) + 1)[:, -1]), None
        window = next(w for w in self._windows if w > max(positions))
        return self._graphs[bucket, window].run(tokens, positions, slots)

    def _capture(self, graph_of: Callable[[Any], Any], one_row: bool = False) -> Any:
        """`graph_of(layer_of)`, a CUDA graph made with the layers compiled by
        torch.compile where that works here, else eager."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        compiled = self._compiled(one_row)
        if compiled is not None:
            try:
                return graph_of(compiled)
            except Exception as error:
                self._compile_failed(error)
        return graph_of(self._layer)

    def _compiled(self, one_row: bool = False) -> Any:
        """The layer compiled by torch.compile (made on first use), or None
        where it is off or failed. Its shapes start static and become dynamic
        where they change (a handful of compiles, not one per size); a one-row
        decode has its own, tuned by coordinate descent: its matmuls become
        reductions whose weight reads Triton tunes."""
        if not self._compile:
            return None
        if one_row not in self._compiled_layers:
            # both share the layer's code, whose compiles dynamo counts together
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       RECOMPILE_LIMIT)
            self._compiled_layers[one_row] = torch.compile(
                self._layer, fullgraph=True, options={"coordinate_descent_tuning": one_row})
        return self._compiled_layers[one_row]

    def _compile_failed(self, error: Exception) -> None:
        """No compiler, no Triton: the eager layer from now on."""
        log.warning("torch.compile failed (%s); the engine runs eager layers",
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        self._compile = False

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor | None, window: int,
                 layer_of: Any = None, visual: _Visual | None = None) -> torch.Tensor:
        """The last layer's output [B, T, hidden] for `tokens` [B, T] at
        `positions` [B, T] of cache `slots` [B] (None: the first B slots, read
        in place), attending over the first `window` positions of each slot;
        `visual`'s rows in place of the embeddings where it says; each layer
        run by `layer_of` (the eager layer unless given)."""
        w, shape = self._weights, self.shape
        batch, length = tokens.shape
        groups = shape.heads // shape.kv_heads
        x = w["embed"][tokens]
        if visual is not None:
            x[visual.at] = visual.rows
        angles = positions[..., None].float() * self._inv_freq  # [B, T, head_dim / 2]
        # rotate_half(x) * sin == x.roll(half) * signed_sin: one kernel fewer
        cos = torch.cat((angles, angles), dim=-1).cos().to(self.dtype)[:, :, None]
        signed_sin = torch.cat((-angles, angles), dim=-1).sin().to(self.dtype)[:, :, None]
        # [B, 1, groups * T, window]: a query sees its own position and those before it
        visible = (self._positions[:window] <= positions[..., None])[:, None]
        visible = visible.expand(batch, groups, length, window).reshape(batch, 1, -1, window)
        rows = (torch.arange(batch, device=self.device) if slots is None else slots)
        rows = rows[:, None].expand(batch, length)
        layer_of = layer_of or self._layer
        for index, layer in enumerate(w["layers"]):
            x = layer_of(x, layer, self._keys[index], self._values[index], cos, signed_sin,
                         rows, positions, slots, visible)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from the last layer's output: final RMSNorm and lm_head."""
        return _rms_norm(x, self._weights["norm"], self.shape.rms_eps) @ self._weights["lm_head"].T

    def _pick(self, logits: torch.Tensor, greedy: torch.Tensor | None,
              states: list[_Sequence]) -> list[tuple[int, float]]:
        """Each of `states`' next token and its log-probability: greedy rows
        from `greedy` (what `_greedy` gives, where the forward computed it;
        else here, on the device), sampled rows through `base.pick` on the host."""
        best, best_logprob = (_greedy(logits) if greedy is None else greedy).tolist()
        sampled = [n for n, s in enumerate(states) if not s.sampling.greedy]
        host = logits[sampled].float().cpu().numpy() if sampled else None
        return [(int(best[n]), best_logprob[n]) if state.sampling.greedy
                else pick(host[sampled.index(n)], state.sampling, state.rng)
                for n, state in enumerate(states)]


@dataclass(frozen=True)
class _Visual:
    """Visual tokens of a prefill: `at` [B, T] marks the image tokens whose
    embeddings `rows` [marked, hidden] replace, in row-major order."""

    at: torch.Tensor
    rows: torch.Tensor


def prefill_length(longest: int, max_context: int) -> int:
    """The length a CUDA prefill of prompts up to `longest` runs at: a power
    of two from 8, a multiple of 512 beyond 512, at most `max_context`."""
    step = 512 if longest > 512 else max(8, 1 << (longest - 1).bit_length())
    return min(max_context, -(-longest // step) * step)


def prefill_shapes(buckets: Sequence[int], max_context: int) -> list[tuple[int, int]]:
    """The (rows, length) shapes of the prefills a CUDA graph runs: rows a
    bucket, the length a `prefill_length`, at most PREFILL_GRAPH_POSITIONS
    positions in all."""
    lengths = sorted({prefill_length(n, max_context) for n in range(1, max_context + 1)})
    return [(rows, length) for rows in buckets for length in lengths
            if rows * length <= PREFILL_GRAPH_POSITIONS]


def _greedy(logits: torch.Tensor) -> torch.Tensor:
    """[2, B] in FP64 (exact for token ids): each row's argmax and its
    log-probability."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = logprobs.argmax(dim=-1)
    return torch.stack((best.double(), logprobs.gather(1, best[:, None])[:, 0].double()))


class _DecodeGraph:
    """One bucket's decode over one window, captured as a CUDA graph over
    static input tensors: row i is slot i; rows of idle slots read token 0 at
    position 0."""

    def __init__(self, engine: TorchGenerativeEngine, bucket: int, window: int,
                 layer_of: Any) -> None:
        device = engine.device
        self.bucket = bucket
        self.tokens = torch.zeros((bucket, 1), dtype=torch.int64, device=device)
        self.positions = torch.zeros((bucket, 1), dtype=torch.int64, device=device)

        def decode() -> torch.Tensor:
            return engine._head(engine._forward(self.tokens, self.positions, None, window,
                                                layer_of)[:, -1])

        self.graph, self.logits, self.greedy = _captured(decode, engine._graph_pool)
        log.debug("captured the decode of %d slots over %d positions as a CUDA graph",
                  bucket, window)

    def run(self, tokens: list[int], positions: list[int], slots: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of `slots`' rows, in their order, and their greedy picks."""
        by_slot = torch.zeros((2, self.bucket), dtype=torch.int64)
        by_slot[0, slots], by_slot[1, slots] = torch.tensor(tokens), torch.tensor(positions)
        self.tokens.copy_(by_slot[0, :, None], non_blocking=True)
        self.positions.copy_(by_slot[1, :, None], non_blocking=True)
        self.graph.replay()
        rows = torch.tensor(slots, device=self.logits.device)
        return self.logits[rows], self.greedy[:, rows]


class _PrefillGraph:
    """A prefill of one shape (rows x length, padded), captured as a CUDA
    graph over static inputs: the prompts' tokens, their slots, and where
    each prompt ends (whose logits it gives)."""

    def __init__(self, engine: TorchGenerativeEngine, rows: int, length: int,
                 layer_of: Any) -> None:
        device = engine.device
        self.tokens = torch.zeros((rows, length), dtype=torch.int64, device=device)
        self.slots = torch.full((rows,), engine.max_sequences, dtype=torch.int64, device=device)
        self.ends = torch.zeros((rows,), dtype=torch.int64, device=device)
        # What the graph reads lives as long as it: attributes, not locals.
        self.positions = engine._positions[:length].expand(rows, length)
        self.rows = torch.arange(rows, device=device)

        def prefill() -> torch.Tensor:
            hidden = engine._forward(self.tokens, self.positions, self.slots, length, layer_of)
            return engine._head(hidden[self.rows, self.ends])

        self.graph, self.logits, self.greedy = _captured(prefill, engine._graph_pool)
        log.debug("captured the prefill of %d prompts of %d positions as a CUDA graph",
                  rows, length)

    def run(self, tokens: torch.Tensor, slots: torch.Tensor, ends: list[int], count: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of the first `count` rows and their greedy picks."""
        self.tokens.copy_(tokens)
        self.slots.copy_(slots)
        self.ends.copy_(torch.tensor(ends), non_blocking=True)
        self.graph.replay()
        return self.logits[:count], self.greedy[:, :count]


def _captured(forward: Callable[[], torch.Tensor], pool: Any
              ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """`forward` captured as a CUDA graph in `pool`, with the logits it
    gives and their greedy picks (`_greedy`), both static outputs."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside the graph, as capture asks
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = forward()
        greedy = _greedy(logits)
    return graph, logits, greedy


def _layer_of(shape: LlamaShape) -> Callable[..., torch.Tensor]:
    """One decoder layer as a function of tensors alone, the shape's sizes its
    constants: torch.compile compiles it once and every layer runs it."""
    heads, kv_heads, head_dim, eps = shape.heads, shape.kv_heads, shape.head_dim, shape.rms_eps
    groups = heads // kv_heads

    def layer(x: torch.Tensor, weights: Mapping[str, torch.Tensor],
              cache_keys: torch.Tensor, cache_values: torch.Tensor, cos: torch.Tensor,
              signed_sin: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor | None, visible: torch.Tensor) -> torch.Tensor:
        batch, length, window = x.shape[0], x.shape[1], visible.shape[-1]
        h = _rms_norm(x, weights["input_norm"], eps)
        qkv = _linear(h, weights, "qkv").view(batch, length, heads + 2 * kv_heads, head_dim)
        qk, v = qkv[:, :, :heads + kv_heads], qkv[:, :, heads + kv_heads:]
        qk = torch.addcmul(qk * cos, qk.roll(head_dim // 2, -1), signed_sin)
        q, k = qk[:, :, :heads], qk[:, :, heads:]  # [B, T, heads | kv_heads, head_dim]
        cache_keys[rows, :, positions] = k
        cache_values[rows, :, positions] = v
        if slots is None:
            keys, values = cache_keys[:batch, :, :window], cache_values[:batch, :, :window]
        else:
            keys, values = cache_keys[slots, :, :window], cache_values[slots, :, :window]
        # A kv head's query heads attend as one [groups * T] block of queries.
        q = q.reshape(batch, length, kv_heads, groups, head_dim).permute(0, 2, 3, 1, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(batch, kv_heads, groups * length, head_dim), keys, values,
            attn_mask=visible)  # [B, kv_heads, groups * T, head_dim]
        attended = attended.reshape(batch, heads, length, head_dim).transpose(1, 2)
        x = x + _linear(attended.reshape(batch, length, -1), weights, "o")
        h = _rms_norm(x, weights["post_norm"], eps)
        gate, up = _linear(h, weights, "gate_up").chunk(2, dim=-1)
        return x + _linear(torch.nn.functional.silu(gate) * up, weights, "down")

    return layer


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, weight.shape, weight, eps)


def _linear(x: torch.Tensor, layer: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    weight = layer[name]
    if weight.dtype == torch.float8_e4m3fn:
        out = _fp8_linear(x, weight, layer[name + "_scale"])
    else:
        out = x @ weight.T
    bias = layer.get(name + "_bias")
    return out if bias is None else out + bias


def _fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] times FP8 weights [out, in] with `scale` [1, out] per output
    channel. Several rows multiply on the FP8 tensor cores, each row of x
    scaled into E4M3's range; one row (a one-stream decode) widens the
    weights inside the matmul instead (fused by torch.compile: it reads one
    byte a weight), as on the CPU and for sizes the tensor cores refuse."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1 or x.device.type == "cpu" or weight.shape[0] % 16 \
            or weight.shape[1] % 16:
        return (x @ weight.to(x.dtype).T) * scale.to(x.dtype)
    row_scale = rows.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    out = torch._scaled_mm((rows / row_scale).to(torch.float8_e4m3fn), weight.T,
                           scale_a=row_scale, scale_b=scale, out_dtype=x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def _to_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weights [out, in] and their scale [1, out] in FP32: each output
    channel's largest magnitude maps to E4M3's largest."""
    wide = weight.float()
    scale = (wide.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
    return (wide / scale).to(torch.float8_e4m3fn), scale.T.contiguous()


def has_fp8_tensor_cores() -> bool:
    """Whether torch's GPU multiplies FP8 (compute capability 8.9: Ada, Hopper on)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


_LAYER_TENSORS = {
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
_LINEAR_WEIGHTS = ("qkv", "o", "gate_up", "down")  # after `_fused`
_OPTIONAL_BIASES = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
                    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
                    "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias",
                    "down_bias": "mlp.down_proj.bias"}


def _load_weights(checkpoint: Path, shape: LlamaShape, dtype: torch.dtype,
                  device: str, fp8: bool = False) -> dict[str, Any]:
    """The checkpoint's tensors by role, in `dtype` on `device` (with `fp8`,
    the linear layers' weights in FP8 and their scales); a missing or
    misshapen tensor is an error naming it."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(file)))

    def take(name: str, expected: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(f"{checkpoint}: tensor {name!r} is missing from *.safetensors")
        tensor = tensors[name]
        if expected is not None and tuple(tensor.shape) != expected:
            raise ConfigError(f"{checkpoint}: tensor {name!r} has shape "
                              f"{list(tensor.shape)}, config.json implies {list(expected)}")
        return tensor.to(device=device, dtype=dtype)

    s = shape
    expected = {"input_norm": (s.hidden,), "post_norm": (s.hidden,),
                "q": (s.heads * s.head_dim, s.hidden), "k": (s.kv_heads * s.head_dim, s.hidden),
                "v": (s.kv_heads * s.head_dim, s.hidden), "o": (s.hidden, s.heads * s.head_dim),
                "gate": None, "up": None, "down": None}
    layers = []
    for index in range(shape.layers):
        prefix = f"model.layers.{index}."
        layer = {role: take(prefix + name, expected[role])
                 for role, name in _LAYER_TENSORS.items()}
        layer.update({role: take(prefix + name) for role, name in _OPTIONAL_BIASES.items()
                      if prefix + name in tensors})
        layer = _fused(layer)
        if fp8:
            for name in _LINEAR_WEIGHTS:
                layer[name], layer[name + "_scale"] = _to_fp8(layer[name])
        layers.append(layer)
    embed = take("model.embed_tokens.weight", (shape.vocab, shape.hidden))
    lm_head = take("lm_head.weight", (shape.vocab, shape.hidden)) \
        if "lm_head.weight" in tensors else embed  # tied embeddings
    return {"embed": embed, "layers": layers, "norm": take("model.norm.weight", (s.hidden,)),
            "lm_head": lm_head}


def _fused(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q, k and v as one projection, and gate and up as another: fewer kernels a
    layer (biases fused alike; a projection without one adds zeros)."""
    for fused, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
        weights = [layer.pop(part) for part in parts]
        layer[fused] = torch.cat(weights)
        biases = [layer.pop(part + "_bias", None) for part in parts]
        if any(b is not None for b in biases):
            layer[fused + "_bias"] = torch.cat([
                torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if b is None else b
                for w, b in zip(weights, biases, strict=True)])
    return layer


def _tensors(weights: Mapping[str, Any]) -> list[torch.Tensor]:
    """Each tensor of `weights` once (tied embeddings are one)."""
    seen: dict[int, torch.Tensor] = {}
    for value in weights.values():
        for tensor in ([value] if isinstance(value, torch.Tensor)
                       else [t for layer in value for t in layer.values()]):
            seen.setdefault(id(tensor), tensor)
    return list(seen.values())


def _device(asked: str) -> str:
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if asked == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda asked for, but torch sees no GPU")
    return asked


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data

