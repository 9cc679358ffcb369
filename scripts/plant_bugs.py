"""Plant the classic DP-SGD bugs (and PRISM's) one at a time and check that the fast tests fail on each.

    python scripts/plant_bugs.py            # every bug
    python scripts/plant_bugs.py M3 M11     # some

Each bug is a one-line edit of the committed code (HEAD), made in a throwaway git worktree, never in this checkout;
the privacy-related test files then run there (``-x``, slow tests deselected) and the first failing test is printed.
A bug that no test catches prints "NOT CAUGHT" and the script exits 1.  The same files run first without any edit:
they must pass, or every bug would look caught.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MUTANTS = {
 "M1 divide by realised batch": ("src/prismdp/privacy/mechanism.py",
   "b, std = float(self.dp.expected_batch_size), self.dp.noise_std",
   "b, std = max(float(clip.examples), 1.0), self.dp.noise_std"),
 "M2 clip bound 1.5 C": ("src/prismdp/privacy/clipping.py",
   "coef = (self.max_grad_norm / (norms + 1e-12)).clamp(max=1.0)",
   "coef = (self.max_grad_norm / (norms + 1e-12)).clamp(max=1.5)"),
 "M3 half noise": ("src/prismdp/privacy/mechanism.py",
   "noise = [std * xi for xi in coords.noise(draws)]",
   "noise = [0.5 * std * xi for xi in coords.noise(draws)]"),
 "M4 per-module clipping": ("src/prismdp/optim/prism.py",
   "sq = sq + inv_root ** 2 * self._norm_sq(fr, gA_t, gB_t).sum(0)",
   "sq = torch.maximum(sq, inv_root ** 2 * self._norm_sq(fr, gA_t, gB_t).amax(0))"),
 "M5 dense params outside the norm": ("src/prismdp/optim/prism.py",
   "            sq = sq + g.flatten(1).square().sum(1)\n",
   "            pass\n"),
 "M6 noise not tangent (no (I-Pi_A))": ("src/prismdp/geometry.py",
   "perp = omega_A - _proj(fr.QA, omega_A)",
   "perp = omega_A"),
 "M7 sampling rate 1.5 q": ("src/prismdp/privacy/sampling.py",
   "yield torch.nonzero(u < self.sample_rate).flatten() * world + rank",
   "yield torch.nonzero(u < 1.5 * self.sample_rate).flatten() * world + rank"),
 "M8 accountant half the steps": ("src/prismdp/privacy/accounting.py",
   "acc.history = [(sigma, sample_rate, steps)]",
   "acc.history = [(sigma, sample_rate, max(1, steps // 2))]"),
 "M9 batch token mean x b (reference code)": ("src/prismdp/losses.py",
   "    return total / count.clamp_min(1)",
   "    return total / count.sum().clamp_min(1) * b"),
 "M10 non-finite example kept": ("src/prismdp/privacy/clipping.py",
   "        coef = torch.where(finite, coef, torch.zeros_like(coef))\n",
   ""),
 "M11 user-level: clip per example": ("src/prismdp/engine.py",
   "self.optimizer.accumulate(grads if groups is None else grads.sum_by(groups, n_units))",
   "self.optimizer.accumulate(grads)"),
 "M12 lift without the -1/2 Pi term": ("src/prismdp/geometry.py",
   "return YA - 0.5 * _proj(fr.QA, YA), YB - 0.5 * _proj(fr.QB, YB)",
   "return YA, YB"),
 "M13 same noise every step": ("src/prismdp/privacy/mechanism.py",
   "draws = self.noise_source.normals([(s.shape, s.dtype, s.device) for s in sums])",
   "draws = [torch.zeros_like(s).normal_(generator=torch.Generator().manual_seed(0)) for s in sums]"),
 "M14 same Poisson sample every step": ("src/prismdp/privacy/sampling.py",
   "u = torch.rand(owned, generator=self.generator, dtype=torch.float64)",
   "u = torch.rand(owned, generator=torch.Generator().manual_seed(0), dtype=torch.float64)"),
 "M15 noise sigma without C": ("src/prismdp/privacy/clipping.py",
   "return self.noise_multiplier * self.max_grad_norm",
   "return self.noise_multiplier"),
 "M16 calibrate for fewer steps": ("src/prismdp/engine.py",
   "noise_multiplier = calibrate_sigma(target_epsilon, delta, q, steps, accountant=accountant)",
   "noise_multiplier = calibrate_sigma(target_epsilon, delta, q, max(1, steps // 2), accountant=accountant)"),
 "M17 resumed sampler replays its batches": ("src/prismdp/privacy/sampling.py",
   "            self.generator.set_state(state[\"generator_state\"].clone())",
   "            pass"),
 "M18 secure noise: every block from one keystream position": ("src/prismdp/privacy/secure.py",
   "counter = (draw << _CALL_SHIFT) | (j << _BLOCK_SHIFT)",
   "counter = draw << _CALL_SHIFT"),
 "M19 secure noise: every draw from one keystream position": ("src/prismdp/privacy/secure.py",
   "counter = (draw << _CALL_SHIFT) | (j << _BLOCK_SHIFT)",
   "counter = j << _BLOCK_SHIFT"),
 "M20 ranks map their draws onto rank 0's examples": ("src/prismdp/privacy/sampling.py",
   "yield torch.nonzero(u < self.sample_rate).flatten() * world + rank",
   "yield torch.nonzero(u < self.sample_rate).flatten() * world"),
 "M21 per-example gradients b times too large (reference code's loss x b under Opacus' rescale)": (
   "src/prismdp/engine.py",
   "        losses.sum().backward()\n",
   "        (losses.sum() * losses.numel()).backward()\n"),
 "M22 one coefficient for the micro-batch (the aggregate clipped, not each example)": (
   "src/prismdp/privacy/clipping.py",
   "norms = torch.where(finite, sq_norms, torch.zeros_like(sq_norms)).clamp_min(0).sqrt()",
   "norms = torch.where(finite, sq_norms, torch.zeros_like(sq_norms)).clamp_min(0).sqrt().sum()"
   ".expand_as(sq_norms)"),
 "M23 dense parameters never updated (reference code's head)": ("src/prismdp/optim/prism.py",
   "        if not self.dense_params:\n            return\n        group = self.param_groups[1]",
   "        return\n        group = self.param_groups[1]"),
 "M24 a resume forgets the budget already spent": ("src/prismdp/privacy/mechanism.py",
   "            self.budget.load_state_dict(state[\"budget\"])",
   "            pass"),
 "M25 a resume restarts the noise stream (the first steps' noise again)": ("src/prismdp/privacy/mechanism.py",
   "        self.noise_source.load_state_dict(state[\"generator\"])",
   "        pass"),
 "M26 fixed-size shuffled batches accounted as Poisson": ("src/prismdp/privacy/sampling.py",
   "yield torch.nonzero(u < self.sample_rate).flatten() * world + rank",
   "yield torch.argsort(u)[: round(self.sample_rate * owned)] * world + rank"),
 "M27 PRISM's per-example norm without its G^T Q_A part (under-clipped)": ("src/prismdp/geometry.py",
   "sq = (resid_A * N_inv).sum((-2, -1)) + ((gB_t @ gB_t.mT) * M_inv).sum((-2, -1))",
   "sq = (resid_A * N_inv).sum((-2, -1))"),
 "M28 PRISM's per-example norm counting Q_A^T G Q_B twice": ("src/prismdp/geometry.py",
   "resid_A = gA_t @ gA_t.mT - Ct @ Ct.mT",
   "resid_A = gA_t @ gA_t.mT"),
 "M29 tangent noise's B side not whitened by R_A (not isotropic)": ("src/prismdp/geometry.py",
   "return _right_solve_t(perp, fr.RB), _right_solve_t(omega_B, fr.RA)",
   "return _right_solve_t(perp, fr.RB), omega_B"),
 "M30 a module called twice: the tap keeps the last call's gradient only": ("src/prismdp/grad_sample.py",
   "stack[part][j].add_(torch.bmm(left, right))",
   "torch.bmm(left, right, out=stack[part][j])"),
}
TESTS = ["tests/test_mechanism.py", "tests/test_privacy.py", "tests/test_engine.py", "tests/test_geometry.py",
         "tests/test_losses.py", "tests/test_user_level.py", "tests/test_grad_sample.py", "tests/test_adaptive.py",
         "tests/test_baselines.py", "tests/test_secure_noise.py", "tests/test_distributed.py"]


def run_tests(root: Path) -> tuple[int, list[str]]:
    env = {"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HOME": str(Path.home())}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", "--no-header",
                        "-m", "not slow", *TESTS], cwd=root, capture_output=True, text=True, env=env)
    return r.returncode, [ln for ln in r.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]


def main(only: list[str]) -> int:
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(root), "HEAD"], check=True)
        try:
            rc, failed = run_tests(root)
            if rc != 0:
                print(f"the tests fail without any bug planted: {failed[:1]}")
                return 2
            for name, (f, old, new) in MUTANTS.items():
                if only and not any(name.startswith(o + " ") for o in only):
                    continue
                path = root / f
                text = path.read_text()
                if text.count(old) != 1:
                    print(f"{name}: the line to edit is not in {f} once (the code moved: update this script)")
                    missed += 1
                    continue
                path.write_text(text.replace(old, new))
                t0 = time.time()
                try:
                    rc, failed = run_tests(root)
                finally:
                    path.write_text(text)
                caught = rc != 0 and failed
                missed += not caught
                print(f"{name}: {'caught by ' + failed[0].split()[1] if caught else 'NOT CAUGHT'} "
                      f"({time.time() - t0:.0f} s)", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(root)], check=False)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
