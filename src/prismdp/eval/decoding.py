"""Greedy decoding of prompts, the same for every generation eval set.

The prompt is the LLM-Adapters training template with an empty output (:func:`prismdp.data.generate_prompt`, i.e.
``generate_prompt`` of LLM-Adapters ``finetune.py`` / the PRISM code's ``build_prompt``), tokenised with the
tokenizer's special tokens like the training examples; prompts are batched (sorted by length, **left**-padded),
decoded **greedily** (``do_sample=False``, one beam) with the KV cache, ``max_new_tokens`` new tokens at most,
stopping at EOS.  Only the new tokens are decoded (special tokens skipped), which equals LLM-Adapters'
``output.split("### Response:")[1]`` up to surrounding whitespace.  Prompts are never truncated.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch

__all__ = ["Generations", "generate"]


class Generations(NamedTuple):
    texts: List[str]  # decoded new tokens, in the order of the prompts
    finished: List[bool]  # True if the generation ended with EOS (False: cut at max_new_tokens)
    prompt_tokens: List[int]


def _eos_ids(model, tokenizer) -> List[int]:
    ids = []
    gen = getattr(model, "generation_config", None)
    cand = getattr(gen, "eos_token_id", None)
    for v in ([tokenizer.eos_token_id] + (list(cand) if isinstance(cand, (list, tuple)) else [cand])):
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    return ids


@torch.no_grad()
def synced_generation(model) -> bool:
    """Whether ``generate`` must keep every rank in its loop until all are done (``synced_gpus``): a base sharded
    across several processes (:mod:`prismdp.sharding`), where every forward is a collective, so a rank that stopped
    decoding early would leave the others waiting in an all-gather.  transformers sets it only for the FSDP it
    applies itself."""
    import torch.distributed as dist

    from ..sharding import is_sharded

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and is_sharded(model)


def generate(model, tokenizer, prompts: Sequence[str], *, batch_size: int = 16, max_new_tokens: int = 8,
             progress: bool = False, desc: str = "generate") -> Generations:
    """Batched greedy decoding with the KV cache and left padding (see the module doc)."""
    from transformers import GenerationConfig

    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError("batch_size and max_new_tokens must be >= 1")
    prompts = list(prompts)
    if not prompts:
        return Generations([], [], [])
    pad = tokenizer.pad_token_id
    if pad is None:
        raise ValueError("the tokenizer has no pad token (load_model sets one)")
    eos = _eos_ids(model, tokenizer)
    if not eos:
        raise ValueError("the tokenizer has no eos token; generation could not stop")
    enc = [list(x) for x in tokenizer(prompts, add_special_tokens=True)["input_ids"]]
    order = sorted(range(len(prompts)), key=lambda i: -len(enc[i]))  # longest first: memory peaks early
    gen_cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=int(max_new_tokens), use_cache=True,
                               pad_token_id=pad, eos_token_id=eos if len(eos) > 1 else eos[0])
    try:
        device = next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        device = torch.device("cpu")
    synced = synced_generation(model)
    texts: List[Optional[str]] = [None] * len(prompts)
    finished: List[bool] = [False] * len(prompts)
    was_training = model.training
    model.eval()
    from tqdm.auto import tqdm

    bar = tqdm(total=len(prompts), desc=desc, unit="ex", disable=not progress, dynamic_ncols=True)
    try:
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            width = max(len(enc[i]) for i in idx)
            ids = torch.full((len(idx), width), int(pad), dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                ids[row, width - len(enc[i]):] = torch.tensor(enc[i], dtype=torch.long)
                mask[row, width - len(enc[i]):] = 1
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen_cfg,
                                 synced_gpus=synced)
            new = out[:, width:].cpu()
            for row, i in enumerate(idx):
                toks = new[row].tolist()
                stop = next((k for k, t in enumerate(toks) if t in eos), None)
                finished[i] = stop is not None
                texts[i] = tokenizer.decode(toks[:stop] if stop is not None else toks, skip_special_tokens=True)
            bar.update(len(idx))
    finally:
        bar.close()
        model.train(was_training)
    return Generations([t or "" for t in texts], finished, [len(e) for e in enc])
