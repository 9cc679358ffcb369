"""--secure-noise: ChaCha20 from an OS key, Holohan-Braghin normals, no seeds, float32 or wider, recorded, resumable."""

import json
import math
import pickle

import numpy as np
import pytest
import scipy.stats
import torch

from helpers import tiny_net
from prismdp.engine import make_private
from prismdp.privacy import PoissonSampler
from prismdp.privacy.clipping import DPConfig
from prismdp.privacy.mechanism import Euclidean, GaussianMechanism
from prismdp.privacy.secure import KEY_BYTES, SecureRandom

KEY = bytes(range(KEY_BYTES))


def test_secure_normals_have_the_standard_normal_law():
    x = SecureRandom(KEY).normal((200_000,), torch.float64, "cpu").numpy()
    assert scipy.stats.kstest(x, "norm").pvalue > 1e-3
    assert abs(x.mean()) < 5 / math.sqrt(x.size) and x.std() == pytest.approx(1.0, abs=5 * math.sqrt(2 / x.size))
    assert abs(scipy.stats.kurtosis(x)) < 0.05  # a Gaussian's excess kurtosis is 0 (sd ~ 0.011 here)


def test_a_secure_normal_is_the_scaled_sum_of_four_chacha_normals():
    # the Holohan-Braghin construction, recomputed from randomgen's ChaCha20 with the same key
    from randomgen import ChaCha

    got = SecureRandom(KEY).normal((3, 5), torch.float64, "cpu").numpy()
    ref = np.random.Generator(ChaCha(key=int.from_bytes(KEY, "little"), rounds=20)).standard_normal((4, 3, 5))
    np.testing.assert_allclose(got, ref.sum(0) / 2, rtol=0, atol=1e-15)


def test_secure_streams_are_keyed_from_the_os_and_take_no_seed():
    a, b = SecureRandom().normal((64,), torch.float64, "cpu"), SecureRandom().normal((64,), torch.float64, "cpu")
    assert not torch.equal(a, b)
    for seed in (42, b"short", "x" * 32):
        with pytest.raises(ValueError, match="not a seed"):
            SecureRandom(seed)
    with pytest.raises(ValueError, match="takes no seed"):
        make_private(tiny_net(), method="dp-adamw", lr=1e-3, dataset_size=10, batch_size=2, steps=3,
                     noise_multiplier=1.0, seed=0, secure_noise=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_secure_noise_on_cuda_is_the_cpu_draw_copied_to_the_device():
    """On CUDA the ChaCha20 draw is cast on the CPU into pinned memory and copied asynchronously: the same values
    as the CPU draw of the same key, on the device, in the release's dtype."""
    got = SecureRandom(KEY).normal((3, 5), torch.float32, "cuda")
    want = SecureRandom(KEY).normal((3, 5), torch.float32, "cpu")
    assert got.device.type == "cuda" and got.dtype == torch.float32
    assert torch.equal(got.cpu(), want)


def test_noise_is_float32_or_wider():
    gen = SecureRandom()
    assert gen.normal((4,), torch.float32, "cpu").dtype == torch.float32
    with pytest.raises(ValueError, match="float32 or wider"):
        gen.normal((4,), torch.float16, "cpu")


def test_secure_mechanism_noise_std_and_checkpoint_holds_no_key():
    sigma, C, b = 2.0, 0.5, 10.0
    mech = GaussianMechanism(DPConfig(sigma, C, b), generator=SecureRandom())
    coords = Euclidean([torch.Size([50, 40])], torch.float32, [torch.device("cpu")])
    noise = torch.stack([mech.release(coords).noise[0] for _ in range(20)])
    assert noise.dtype == torch.float32
    assert float(noise.std()) == pytest.approx(sigma * C, rel=0.02)  # 40,000 draws: sd of the estimate ~0.4 %
    state = mech.state_dict()
    assert state["generator"] == {"secure": True}  # nothing that could regenerate the noise
    assert len(pickle.dumps(state)) < 200
    mech.load_state_dict(state)  # resume: a fresh key continues
    torch_mech = GaussianMechanism(DPConfig(sigma, C, b))
    with pytest.raises(ValueError, match="secure"):
        torch_mech.load_state_dict(state)


def test_secure_poisson_sampling_rate_and_resume():
    sampler = PoissonSampler(2000, 0.1, 50, generator=SecureRandom())
    it = iter(sampler)
    sizes = [len(next(it)) for _ in range(20)]
    assert 0.09 * 2000 < np.mean(sizes) < 0.11 * 2000  # 20 x 2000 Bernoulli(0.1): sd of the mean 0.3 %
    state = sampler.state_dict()
    resumed = PoissonSampler(2000, 0.1, 50, generator=SecureRandom())
    resumed.load_state_dict(state)
    assert len(resumed) == 30
    with pytest.raises(ValueError, match="secure-noise"):
        PoissonSampler(2000, 0.1, 50, generator=0).load_state_dict(state)


def test_secure_run_reports_its_generator_and_resumes(tiny_bert_dir, tmp_path):
    from prismdp.cli import main

    common = ["--model", tiny_bert_dir, "--synthetic-train", "32", "--synthetic-test", "8", "--steps", "4",
              "--batch-size", "8", "--micro-batch-size", "16", "--rank", "2", "--max-length", "16", "--quiet",
              "--checkpoint-every", "2", "--secure-noise", "--output", str(tmp_path / "s")]
    assert main(["train", *common, "--stop-after", "2"]) == 0
    assert main(["train", *common, "--resume"]) == 0
    privacy = json.loads((tmp_path / "s" / "privacy.json").read_text())
    assert privacy["secure_noise"] is True and privacy["steps"] == 4
    assert "ChaCha20" in privacy["noise_source"]["generator"]
    assert "Holohan" in privacy["noise_source"]["gaussian"]
    assert json.loads((tmp_path / "s" / "config.json").read_text())["secure_noise"] is True
