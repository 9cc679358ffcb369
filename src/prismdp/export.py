"""Write a trained adapter that a stock ``peft.PeftModel.from_pretrained(<original base>, dir)`` reproduces.

PRISM trains ``Z`` on top of base weights from which the start point ``Z0`` was subtracted.  For the original
base weights the adapter must hold ``Z - Z0 = [A, -A0] [B, B0]^T`` (rank <= 2r): we export a rank-2r LoRA with
``lora_alpha = 2r`` (``scaling = 1``; ``sqrt(2r)`` under rsLoRA), so ``lora_B = [A, -A0]``,
``lora_A = [B, B0]^T``.  Methods without a moved start export their factors as they are.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from .atomic import atomic_path, write_json
from .lora import LoraPair, RankRStart, get_factors

__all__ = ["export_adapter"]


def export_adapter(model: nn.Module, pairs: list[LoraPair], start: RankRStart | None, out_dir: str | os.PathLike,
                   adapter: str = "default", head: dict | None = None) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (each atomically) into ``out_dir``, leaving its
    other files alone (a Trainer checkpoint folder holds more).

    ``head`` (e.g. ``{"pooling": "mean", "num_labels": 2}``) goes to ``prismdp_head.json``: the adapter then applies
    to ``prismdp.models.load_model(base, "seq_cls", num_labels, pooling=...)``, not to the stock HF head.
    """
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    out = Path(out_dir)
    config = copy.deepcopy(model.peft_config[adapter])
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model, adapter_name=adapter).items()}
    if start is not None:
        r = pairs[0].shape[2]
        if config.rank_pattern or config.alpha_pattern or any(p.shape[2] != r for p in pairs):
            raise ValueError("exporting a PRISM adapter with per-module ranks (rank_pattern/alpha_pattern) is not supported")
        for pair, (A0, B0) in zip(pairs, start.factors):
            A, B = get_factors(pair, torch.float32)
            dtype = pair.lora_A.weight.dtype
            state[f"{pair.name}.lora_A.weight"] = torch.cat([B, B0], dim=1).T.to(dtype).contiguous()
            state[f"{pair.name}.lora_B.weight"] = torch.cat([A, -A0], dim=1).to(dtype).contiguous()
        config.r = 2 * r
        config.lora_alpha = math.sqrt(2 * r) if config.use_rslora else 2 * r
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "adapter_model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    with tempfile.TemporaryDirectory(dir=out, prefix=".adapter_config.") as tmp:  # PEFT's own serialisation
        config.save_pretrained(tmp)
        os.replace(Path(tmp) / "adapter_config.json", out / "adapter_config.json")
    if head is not None:
        write_json(out / "prismdp_head.json", head)
    else:
        (out / "prismdp_head.json").unlink(missing_ok=True)  # a stale head from an earlier export
    return out
