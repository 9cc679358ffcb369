"""The GPU benchmark's model shapes (:mod:`bench.gpu`): random-init Llama-3.2-1B and Gemma-3-4B (text) written out as
configs (no downloads), built directly on the device in bf16; their model FLOPs per token; the chips' bf16 peaks.

FLOPs per trained token of LoRA training on a frozen base (:func:`flops_per_token`), matrix products only:

* ``base``: ``4 N`` for the ``N`` weights of the decoder layers' linear maps: 2 for the forward product, 2 for the
  gradient with respect to its input (the frozen weights get no gradient).
* ``attention``: per layer ``12 c H d_head`` (``Q K^T`` and ``P V``, 2 products of 2 FLOPs per multiply-add
  forward, twice that backward), ``c`` the context: the sequence length, or the sliding window if shorter; counted
  at full length as the usual MFU convention does (a causal kernel skips about half).
* ``head``: ``4 d V``: the logits and the gradient of the last hidden state (the tied, frozen head).
* ``lora``: ``6 r (n + m)`` per adapted ``n -> m`` map: ``x A^T`` and ``(.) B^T`` forward, their input gradients
  and the factors' gradients (per-example or summed, the same products).

Not counted: norms, activations, rotary embeddings, softmax, the loss, the embedding lookup, the optimizer and the
DP mechanism.  Every variant of a shape gets the same count (the work a step must do), so model-FLOP utilisation
compares throughput; PRISM's dropout compensation (a LoRA branch of width 2r) is overhead on top of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "up_proj", "down_proj")

# dense bf16 tensor-core peaks (TFLOP/s, no sparsity), from NVIDIA's data sheets; first match of the device name wins
BF16_PEAK_TFLOPS: Tuple[Tuple[str, float], ...] = (
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("GH200", 989.0), ("H100", 989.0),
    ("A100", 312.0),
)


def bf16_peak_tflops(device_name: str) -> float | None:
    """The chip's dense bf16 peak by device name (e.g. ``NVIDIA H100 80GB HBM3`` -> 989), None if not in the table."""
    for key, tflops in BF16_PEAK_TFLOPS:
        if key.lower() in device_name.lower():
            return tflops
    return None


def sanitize(name: str) -> str:
    """A device name as a file-name part: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def _classes(family: str) -> tuple[type, type]:
    """(config class, model class) of a model family."""
    import transformers as tf

    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[family]


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    family: str  # "llama" | "gemma3"
    config: Dict[str, object]  # the config's fields (everything else: transformers' defaults)
    batch: int  # logical batch
    seq_len: int
    micro_sizes: Tuple[int, ...]
    rank: int = 16
    targets: Tuple[str, ...] = TARGETS

    def make_config(self):
        return _classes(self.family)[0](**self.config)

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


# Llama-3.2-1B (meta-llama/Llama-3.2-1B config.json; rope scaling left at the default: it does not change the cost)
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=True)
# Gemma-3-4B's text model (google/gemma-3-4b-pt text_config: 5 sliding-window layers to 1 global)
GEMMA3_4B = dict(vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                 query_pre_attn_scalar=256, max_position_embeddings=131072, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)

SHAPES: Dict[str, Shape] = {
    "llama-3.2-1b": Shape("llama-3.2-1b", "random-init Llama-3.2-1B, bf16 base, float32 LoRA r 16 on "
                          "q/k/v/up/down, logical batch 32 x 256 tokens", "llama", LLAMA_1B, 32, 256, (4, 8, 16, 32)),
    "gemma-3-4b": Shape("gemma-3-4b", "random-init Gemma-3-4B text model, bf16 base, float32 LoRA r 16 on "
                        "q/k/v/up/down, logical batch 16 x 256 tokens", "gemma3", GEMMA3_4B, 16, 256, (4, 8, 16)),
    # tiny stand-ins with the same structure (the test suite runs the benchmark on the CPU with these)
    "tiny-llama": Shape("tiny-llama", "tiny random Llama, LoRA r 4, logical batch 8 x 16 tokens", "llama",
                        dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                             tie_word_embeddings=True), 8, 16, (2, 4, 8), rank=4),
    "tiny-gemma": Shape("tiny-gemma", "tiny random Gemma-3 text model (one sliding-window layer of 8, one global), "
                        "LoRA r 4, logical batch 4 x 16 tokens", "gemma3",
                        dict(vocab_size=320, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32,
                             max_position_embeddings=64, tie_word_embeddings=True), 4, 16, (2, 4), rank=4),
    # Llama-3.2-1B's structure (16 layers, the same five targets and four stacks, logical batch 32 as
    # micro-batches of 16 / 32) at width 64: the real shape's operators and kernel launches at a size where the
    # host's work is the step (a host-bound GPU step's cost, measured on the CPU)
    "narrow-llama": Shape("narrow-llama", "Llama-3.2-1B's structure at width 64 (16 layers, LoRA r 4 on "
                          "q/k/v/up/down), logical batch 32 x 16 tokens", "llama",
                          dict(LLAMA_1B, vocab_size=256, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, max_position_embeddings=64),
                          32, 16, (16, 32), rank=4),
}
GPU_SHAPES = ("llama-3.2-1b", "gemma-3-4b")
TINY_SHAPES = ("tiny-llama", "tiny-gemma")


def build_base(shape: Shape, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, seed: int = 0
               ) -> nn.Module:
    """The random-init model of ``shape``, its tensors created on ``device`` in ``dtype`` (no host copy; ``meta``
    gives the structure without memory)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = _classes(shape.family)[1]._from_config(shape.make_config(), dtype=dtype)
    where = {(t.device.type, t.dtype) for t in model.parameters()}
    if where != {(torch.device(device).type, dtype)}:  # should transformers ever build elsewhere: move it
        model = model.to(device=device, dtype=dtype)
    return model.train()


def _layer_maps(cfg) -> Dict[str, Tuple[int, int]]:
    """(in, out) of every linear map of one decoder layer, from the config."""
    d, ff, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d)}


def _contexts(cfg, seq_len: int) -> list[int]:
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    return [min(seq_len, window) if t == "sliding_attention" and window else seq_len for t in types]


def flops_per_token(shape: Shape) -> Dict[str, float]:
    """Model FLOPs per trained token, by term (see the module docstring) and ``total``."""
    cfg = shape.make_config()
    maps = _layer_maps(cfg)
    L, r = cfg.num_hidden_layers, shape.rank
    terms = {
        "base": 4.0 * L * sum(n * m for n, m in maps.values()),
        "attention": 12.0 * cfg.num_attention_heads * cfg.head_dim * sum(_contexts(cfg, shape.seq_len)),
        "head": 4.0 * cfg.hidden_size * cfg.vocab_size,
        "lora": 6.0 * r * L * sum(n + m for name, (n, m) in maps.items() if name in shape.targets),
    }
    terms["total"] = sum(terms.values())
    return terms


FLOP_TERMS = {  # the report's explanation of each term
    "base": "4 N (N: decoder linear weights; forward + input gradient)",
    "attention": "12 c H d_head per layer (c: length or sliding window; full length, not halved for causality)",
    "head": "4 d V (logits + gradient of the last hidden state)",
    "lora": "6 r (n + m) per adapted n -> m map",
}
