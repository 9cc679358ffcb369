"""prismdp: differentially private LoRA fine-tuning with PRISM (gauge-invariant tangent-space DP-SGD).

Subpackages, one idea each: :mod:`prismdp.geometry` (rank-r manifold math), :mod:`prismdp.lora` (PEFT LoRA
pairs as manifold points), :mod:`prismdp.grad_sample` (per-example gradients), :mod:`prismdp.privacy`
(clipping, noise, sampling, accounting), :mod:`prismdp.optim` (PRISM and the factor-space baselines).
"""

__version__ = "0.1.0"


def code_version() -> str:
    """``__version__``, plus the git commit (and ``+dirty``) when prismdp runs from a git checkout: recorded in every
    run's config.json, so results can be traced to the code that produced them."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "src"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+{commit}{'.dirty' if dirty else ''}" if commit else __version__
