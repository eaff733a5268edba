"""The datacenter's generative engine: a Llama checkpoint (config.json,
*.safetensors, tokenizer.json) run by our own forward in torch, with a static
KV cache and one batched decode step for every running sequence.

The forward follows Llama's architecture and transformers' numerics: token
embedding; per layer RMSNorm (in FP32), grouped-query attention with rotary
position embedding (rotate-half form, angles in FP32), softmax in FP32, a
residual, RMSNorm and a SwiGLU MLP, a residual; a final RMSNorm and lm_head.

The KV cache is preallocated: one slot of `max_context` positions per
sequence that may run (`max_sequences`), plus one scratch slot that padded
rows and teacher-forced scoring write into. A new sequence is prefilled alone
(its whole prompt in one forward) on its first step; every sequence already
prefilled advances in one batched decode forward, so sequences join and
leave between steps (in-flight batching). Stale keys a slot's previous
sequence left are never read: a query attends only to positions up to its
own.

Decode has static shapes on CUDA (the batch padded to a bucket of
`cuda_graph_batch_sizes`, attention over the whole context, slot and position
given as tensors), so each bucket's decode is captured once as a CUDA graph
and replayed. On the CPU the batch is not padded and attention reads only the
positions written so far.

Never imports the agent or the wire protocol: token ids and text in, tokens out.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiered import names
from tiered.engines.generative import is_checkpoint
from tiered.engines.generative.base import GenerativeEngine, Sampling, Token, pick
from tiered.errors import ConfigError, InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = {names.Precision.FP32: torch.float32, names.Precision.FP16: torch.float16,
          names.Precision.BF16: torch.bfloat16}


@dataclass(frozen=True)
class TorchGenerativeSettings:
    """How the torch engine runs a checkpoint (a model's config.yaml `engine:`)."""

    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu
    precision: str = "fp16"  # fp32 | fp16 | bf16; on the CPU fp32 or bf16
    max_sequences: int = 16  # KV cache slots: sequences that may run at once
    max_context: int = 0  # positions per slot; 0: the model's max_position_embeddings
    max_cache_mib: int = 4096  # refuse a KV cache larger than this
    cuda_graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # decode buckets (CUDA)
    cuda_graphs: bool = True  # capture each bucket's decode once (CUDA only)
    threads: int = 0  # torch intra-op threads on the CPU; 0 leaves torch's default

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.precision not in DTYPES:
            raise ConfigError(f"precision: {self.precision!r} is not one of "
                              f"{', '.join(DTYPES)}")
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
    __slots__ = ("slot", "prompt", "length", "next_input", "sampling", "generated", "rng")

    def __init__(self, slot: int, prompt: list[int], sampling: Sampling) -> None:
        self.slot = slot
        self.prompt: list[int] | None = prompt  # until prefilled
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
        self.precision = settings.precision
        self.dtype = DTYPES[settings.precision]
        config = _read_json(checkpoint / "config.json")
        self.shape = shape = LlamaShape.read(config, f"{checkpoint}/config.json")
        self.max_context = settings.max_context or shape.max_positions
        if self.max_context > shape.max_positions:
            raise ConfigError(f"max_context: {self.max_context} exceeds the model's "
                              f"max_position_embeddings {shape.max_positions}")
        self.max_sequences = settings.max_sequences
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        self._weights = _load_weights(checkpoint, shape, self.dtype, self.device)
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
        self._free = list(range(self.max_sequences))
        self._sequences: dict[int, _Sequence] = {}
        self._ids = itertools.count(1)
        self._graphs: dict[int, _DecodeGraph] = {}
        self._use_graphs = self.device == "cuda" and settings.cuda_graphs

    # -- the interface -------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)

    def start(self, prompt: Sequence[int], sampling: Sampling) -> int:
        self.check_fits(prompt, sampling)
        bad = [t for t in prompt if not 0 <= t < self.shape.vocab]
        if bad:
            raise InvalidArgument(f"text_input: token id {bad[0]} is outside the "
                                  f"vocabulary of {self.shape.vocab}")
        if not self._free:  # check_fits counted running sequences; slots agree
            raise ResourceExhausted(f"all {self.max_sequences} sequences are running")
        sequence = next(self._ids)
        self._sequences[sequence] = _Sequence(self._free.pop(), list(prompt), sampling)
        return sequence

    def step(self) -> list[Token]:
        new = [(i, s) for i, s in self._sequences.items() if s.prompt is not None]
        old = [(i, s) for i, s in self._sequences.items() if s.prompt is None]
        rows: list[tuple[int, _Sequence, torch.Tensor]] = []
        with torch.inference_mode():
            if old:
                logits = self._decode([s for _, s in old])
                rows += [(i, s, logits[n]) for n, (i, s) in enumerate(old)]
            for i, s in new:
                rows.append((i, s, self._prefill(s)))
            if not rows:
                return []
            logits = torch.stack([row for _, _, row in rows]).float()
            picks = self._pick(logits, [s.sampling for _, s, _ in rows],
                               [s.rng for _, s, _ in rows])
        tokens = []
        for (sequence, state, _), (token, logprob) in zip(rows, picks, strict=True):
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
            self._free.append(state.slot)

    @property
    def running(self) -> int:
        return len(self._sequences)

    def describe(self) -> dict[str, str]:
        return {"engine": "torch", "device": self.device, "precision": self.precision,
                "context": str(self.max_context), "sequences": str(self.max_sequences),
                "kv_cache_mib": f"{self.cache_bytes / (1 << 20):.1f}",
                "cuda_graphs": str(self._use_graphs).lower()}

    def close(self) -> None:
        self._sequences.clear()
        self._graphs.clear()

    def prefix_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits after each prefix of `ids` (teacher forcing), FP32 [len, vocab];
        written into the scratch slot, so running sequences are untouched."""
        if not ids or len(ids) > self.max_context:
            raise InvalidArgument(f"ids: 1..{self.max_context} tokens, got {len(ids)}")
        with torch.inference_mode():
            tokens = torch.tensor([list(ids)], device=self.device)
            positions = self._positions[:len(ids)].unsqueeze(0)
            slots = torch.tensor([self.max_sequences], device=self.device)
            logits = self._forward(tokens, positions, slots, len(ids), last_only=False)
            return logits[0].float().cpu().numpy()

    # -- the forward ---------------------------------------------------------

    def _prefill(self, state: _Sequence) -> torch.Tensor:
        prompt = state.prompt
        assert prompt is not None
        tokens = torch.tensor([prompt], device=self.device)
        positions = self._positions[:len(prompt)].unsqueeze(0)
        slots = torch.tensor([state.slot], device=self.device)
        logits = self._forward(tokens, positions, slots, len(prompt), last_only=True)
        state.prompt = None
        state.length = len(prompt)
        return logits[0, -1]

    def _decode(self, states: list[_Sequence]) -> torch.Tensor:
        """One token's logits for each of `states`, in one forward; each
        sequence's cache grows by its last token."""
        tokens = [s.next_input for s in states]
        positions = [s.length for s in states]
        slots = [s.slot for s in states]
        for s in states:
            s.length += 1
        bucket = next((b for b in sorted(self.settings.cuda_graph_batch_sizes)
                       if b >= len(states)), None) if self._use_graphs else None
        if bucket is None:  # eager (beyond the largest bucket too): read what is written
            return self._forward(torch.tensor(tokens, device=self.device).unsqueeze(1),
                                 torch.tensor(positions, device=self.device).unsqueeze(1),
                                 torch.tensor(slots, device=self.device), max(positions) + 1,
                                 last_only=True)[:, -1]
        graph = self._graphs.get(bucket)
        if graph is None:
            graph = self._graphs[bucket] = _DecodeGraph(self, bucket)
        return graph.run(tokens, positions, slots)[:len(states)]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 window: int, *, last_only: bool) -> torch.Tensor:
        """Logits for `tokens` [B, T] at `positions` [B, T] of cache `slots` [B],
        attending over the first `window` positions of each slot."""
        w, shape = self._weights, self.shape
        batch, length = tokens.shape
        x = w["embed"][tokens]
        angles = positions[..., None].float() * self._inv_freq  # [B, T, head_dim / 2]
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(self.dtype)[:, None], angles.sin().to(self.dtype)[:, None]
        keys_at = self._positions[:window]
        # [B, 1, 1, T, window]: a query sees its own position and those before it.
        visible = (keys_at[None, None, :] <= positions[..., None])[:, None, None]
        rows = slots[:, None].expand(batch, length)
        groups = shape.heads // shape.kv_heads
        for index, layer in enumerate(w["layers"]):
            h = _rms_norm(x, layer["input_norm"], shape.rms_eps)
            q = _linear(h, layer, "q").view(batch, length, shape.heads, shape.head_dim)
            k = _linear(h, layer, "k").view(batch, length, shape.kv_heads, shape.head_dim)
            v = _linear(h, layer, "v").view(batch, length, shape.kv_heads, shape.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self._keys[index][rows, :, positions] = k.transpose(1, 2)
            self._values[index][rows, :, positions] = v.transpose(1, 2)
            keys = self._keys[index][slots, :, :window]  # [B, kv_heads, window, head_dim]
            values = self._values[index][slots, :, :window]
            q = q.reshape(batch, shape.kv_heads, groups, length, shape.head_dim)
            scores = (q @ keys[:, :, None].transpose(-1, -2)) * shape.head_dim ** -0.5
            scores = scores.masked_fill(~visible, float("-inf"))
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(self.dtype)
            attended = (weights @ values[:, :, None])  # [B, kv_heads, groups, T, head_dim]
            attended = attended.reshape(batch, shape.heads, length, shape.head_dim)
            x = x + _linear(attended.transpose(1, 2).reshape(batch, length, -1), layer, "o")
            h = _rms_norm(x, layer["post_norm"], shape.rms_eps)
            gate = torch.nn.functional.silu(_linear(h, layer, "gate"))
            x = x + _linear(gate * _linear(h, layer, "up"), layer, "down")
        if last_only:
            x = x[:, -1:]
        x = _rms_norm(x, w["norm"], shape.rms_eps)
        return x @ w["lm_head"].T

    def _pick(self, logits: torch.Tensor, samplings: list[Sampling],
              rngs: list[np.random.Generator]) -> list[tuple[int, float]]:
        """Greedy rows on the device (argmax and its log-probability); sampled
        rows through `base.pick` on the host."""
        logprobs = torch.log_softmax(logits, dim=-1)
        best = logprobs.argmax(dim=-1)
        best_logprob = logprobs.gather(1, best[:, None])[:, 0]
        best, best_logprob = best.tolist(), best_logprob.tolist()
        picks = []
        sampled = [n for n, s in enumerate(samplings) if not s.greedy]
        host = logits[sampled].cpu().numpy() if sampled else None
        for n, sampling in enumerate(samplings):
            if sampling.greedy:
                picks.append((int(best[n]), float(best_logprob[n])))
            else:
                picks.append(pick(host[sampled.index(n)], sampling, rngs[n]))
        return picks


class _DecodeGraph:
    """One bucket's decode captured as a CUDA graph over static input tensors;
    rows beyond the batch write into the scratch slot at position 0."""

    def __init__(self, engine: TorchGenerativeEngine, bucket: int) -> None:
        device = engine.device
        self.bucket = bucket
        self.scratch = engine.max_sequences
        self.tokens = torch.zeros((bucket, 1), dtype=torch.int64, device=device)
        self.positions = torch.zeros((bucket, 1), dtype=torch.int64, device=device)
        self.slots = torch.full((bucket,), self.scratch, dtype=torch.int64, device=device)

        def decode() -> torch.Tensor:
            return engine._forward(self.tokens, self.positions, self.slots, engine.max_context,
                                   last_only=True)[:, -1]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph, as capture asks
                decode()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = decode()
        log.info("captured the decode of %d sequences as a CUDA graph", bucket)

    def run(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        pad = self.bucket - len(tokens)
        self.tokens.copy_(torch.tensor([*tokens, *[0] * pad])[:, None], non_blocking=True)
        self.positions.copy_(torch.tensor([*positions, *[0] * pad])[:, None],
                             non_blocking=True)
        self.slots.copy_(torch.tensor([*slots, *[self.scratch] * pad]), non_blocking=True)
        self.graph.replay()
        return self.logits


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    wide = x.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _linear(x: torch.Tensor, layer: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    out = x @ layer[name].T
    bias = layer.get(name + "_bias")
    return out if bias is None else out + bias


_LAYER_TENSORS = {
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
_OPTIONAL_BIASES = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
                    "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias",
                    "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias",
                    "down_bias": "mlp.down_proj.bias"}


def _load_weights(checkpoint: Path, shape: LlamaShape, dtype: torch.dtype,
                  device: str) -> dict[str, Any]:
    """The checkpoint's tensors by role, in `dtype` on `device`; a missing or
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
        layers.append(layer)
    embed = take("model.embed_tokens.weight", (shape.vocab, shape.hidden))
    lm_head = take("lm_head.weight", (shape.vocab, shape.hidden)) \
        if "lm_head.weight" in tensors else embed  # tied embeddings
    return {"embed": embed, "layers": layers, "norm": take("model.norm.weight", (s.hidden,)),
            "lm_head": lm_head}


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

