"""Tiny random-init models and batches shared by the tests (no downloads)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM


def tiny_bert_cls(num_labels: int = 2, r: int = 4, targets=("query", "value"), dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    cfg = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=64, num_labels=num_labels, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    base = BertForSequenceClassification(cfg).eval()
    lcfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=list(targets), task_type="SEQ_CLS")
    return get_peft_model(base, lcfg)


def tiny_llama(r: int = 4, targets=("q_proj", "v_proj", "up_proj", "down_proj"), seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    )
    base = LlamaForCausalLM(cfg).eval()
    lcfg = LoraConfig(r=r, lora_alpha=r, lora_dropout=dropout, target_modules=list(targets), task_type="CAUSAL_LM")
    return get_peft_model(base, lcfg)


def padded_batch(lengths, vocab=100, seed=0, pad_id=0):
    """Right-padded random token batch with its attention mask."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.full((len(lengths), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), T), dtype=torch.long)
    for i, L in enumerate(lengths):
        ids[i, :L] = torch.randint(1, vocab, (L,), generator=g)
        mask[i, :L] = 1
    return ids, mask


class TinyNet(torch.nn.Module):
    """x (b, T, n) -> mean over T of head(proj3(proj2(act(proj(x))))): three LoRA-able linears (two of the same
    shape, so PRISM batches them as one group) and a dense head."""

    def __init__(self, n=10, m=12, k=3):
        super().__init__()
        self.proj = torch.nn.Linear(n, m)
        self.proj2 = torch.nn.Linear(m, m)
        self.proj3 = torch.nn.Linear(m, m)
        self.head = torch.nn.Linear(m, k)

    def forward(self, x):
        return self.head(self.proj3(torch.tanh(self.proj2(torch.tanh(self.proj(x)))))).mean(1)


def tiny_net(r=2, seed=0, head=True, dtype=torch.float32, dropout=0.0):
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=["proj", "proj2", "proj3"],
                     modules_to_save=["head"] if head else None)
    return get_peft_model(TinyNet().to(dtype), cfg)


def net_batch(b, seed=0, T=5, n=10, k=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, T, n, generator=g, dtype=dtype), torch.randint(0, k, (b,), generator=g)


def per_example(model, sampler, x, y):
    """Per-example gradients of the summed per-example classification losses of one batch."""
    from prismdp.losses import classification_losses

    with sampler.record() as rec:
        classification_losses(model(x), y).sum().backward()
    model.zero_grad(set_to_none=True)
    return sampler.grads(rec)


def gauge_transform(pairs, seed):
    """(A, B) -> (A R, B R^-T) with a random invertible R per pair: Z is unchanged."""
    from prismdp.lora import get_factors, set_factors

    g = torch.Generator().manual_seed(seed)
    for pair in pairs:
        A, B = get_factors(pair, torch.float64)
        r = A.shape[1]
        R = torch.randn(r, r, generator=g, dtype=torch.float64) + 2 * torch.eye(r, dtype=torch.float64)
        set_factors(pair, A @ R, B @ torch.linalg.inv(R).T)


def mechanism(sigma, C, b, seed=None, budget=None):
    """A Gaussian mechanism with noise multiplier ``sigma``, clipping bound ``C``, expected batch ``b``."""
    from prismdp.privacy.clipping import DPConfig
    from prismdp.privacy.mechanism import GaussianMechanism

    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return GaussianMechanism(DPConfig(sigma, C, b), generator=gen, budget=budget)


def train_steps(model, sampler, opt, x, y, steps, private=True):
    """``steps`` optimizer steps on the fixed batch (x, y): per-example gradients into the private optimizer, or the
    batch-mean loss's backward for a non-private one."""
    from prismdp.losses import classification_losses

    for _ in range(steps):
        if private:
            opt.accumulate(per_example(model, sampler, x, y))
        else:
            classification_losses(model(x), y).mean().backward()
        opt.step()
        model.zero_grad(set_to_none=True)


def randomise_lora_B(model, seed=5, scale=0.3):
    """Non-zero lora_B, so that lora_A has a non-zero gradient (PEFT starts from lora_B = 0)."""
    from prismdp.lora import find_lora_pairs

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pair in find_lora_pairs(model):
            w = pair.lora_B.weight
            w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * scale)


def method_setup(method, sigma=0.0, b=4.0, clip=0.5, noise_seed=1, private=True, lr=0.05, seed=1,
                 dtype=torch.float32, budget=None):
    """tiny_net and method's optimizer as make_private builds them (prepare, pair discovery, rank-r start, builder),
    with a seeded Gaussian mechanism (sigma, C = clip, expected batch b) or none (``private=False``).  Methods without
    the rank-r start get a random lora_B first.  Returns (model, pairs, sampler, optimizer)."""
    from prismdp.engine import METHODS
    from prismdp.grad_sample import GradSampler
    from prismdp.lora import find_lora_pairs, move_to_rank_r_start

    model = tiny_net(seed=seed, dtype=dtype)
    spec = METHODS[method]
    if not spec.rank_r_start:
        randomise_lora_B(model)
    if spec.prepare is not None:
        spec.prepare(model, "default")
    pairs = find_lora_pairs(model, trainable=spec.trainable)
    if spec.rank_r_start:
        move_to_rank_r_start(pairs)
    sampler = GradSampler(model, pairs)
    mech = mechanism(sigma, clip, b, noise_seed, budget=budget) if private else None
    return model, pairs, sampler, spec.build(pairs, sampler.dense_params, lr=lr, mechanism=mech)


def interrupt_when_logged(metrics: Path, steps: int, pid: int | None = None, sig=signal.SIGINT):
    """A thread that sends ``sig`` to ``pid`` (this process by default) once ``metrics`` holds ``steps`` records:
    Ctrl-C in the middle of a run."""
    def watch():
        deadline = time.time() + 600
        while time.time() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
                os.kill(pid or os.getpid(), sig)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
