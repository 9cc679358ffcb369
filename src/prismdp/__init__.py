"""prismdp: differentially private LoRA fine-tuning with PRISM (gauge-invariant tangent-space DP-SGD).

Subpackages, one idea each: :mod:`prismdp.geometry` (rank-r manifold math), :mod:`prismdp.lora` (PEFT LoRA
pairs as manifold points), :mod:`prismdp.grad_sample` (per-example gradients), :mod:`prismdp.privacy`
(clipping, noise, sampling, accounting), :mod:`prismdp.optim` (PRISM and the factor-space baselines).
"""

__version__ = "0.1.0"
