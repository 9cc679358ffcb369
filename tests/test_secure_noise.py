"""--secure-noise: ChaCha20 from an OS key, Holohan-Braghin normals, no seeds, float32 or wider, recorded, resumable."""

import copy
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


def test_a_secure_normal_is_the_scaled_sum_of_four_chacha_normals(monkeypatch):
    # the Holohan-Braghin construction, recomputed from randomgen's ChaCha20 with the same key: block j of the c-th
    # draw from the counter c * 2^64 + j * 2^40 (blocks of 4 coordinates here, so a (3, 5) draw spans 4 blocks)
    from randomgen import ChaCha

    import prismdp.privacy.secure as secure

    monkeypatch.setattr(secure, "BLOCK", 4)
    gen = SecureRandom(KEY)
    gen.normal((2,), torch.float64, "cpu")  # draw 1
    got = gen.normal((3, 5), torch.float64, "cpu").numpy().ravel()  # draw 2
    key = int.from_bytes(KEY, "little")
    ref = np.concatenate([np.random.Generator(ChaCha(key=key, counter=(2 << 64) | (j << 40), rounds=20))
                          .standard_normal((4, min(4, 15 - 4 * j))).sum(0) / 2 for j in range(4)])
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-15)


def test_secure_noise_does_not_depend_on_the_number_of_threads(monkeypatch):
    # ranks that share a key must draw the same noise whatever their thread settings (blocks, not threads, own the
    # keystream positions); and the blocks are independent draws, not copies
    import prismdp.privacy.secure as secure

    monkeypatch.setattr(secure, "BLOCK", 1000)
    draws = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            gen = SecureRandom(KEY)
            draws[n] = [gen.normal((10_007,), torch.float32, "cpu") for _ in range(2)]
            copy.deepcopy(gen)  # its thread pool is not copied (a pool cannot be)
    finally:
        torch.set_num_threads(threads)
    for n in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(draws[1], draws[n]))
    first, second = draws[1]
    assert not torch.equal(first, second)
    blocks = first[:10_000].view(10, 1000)
    assert all(not torch.equal(blocks[0], blocks[j]) for j in range(1, 10))
    assert scipy.stats.kstest(torch.cat([first, second]).double().numpy(), "norm").pvalue > 1e-3


def test_noise_threads_set_the_pool_whatever_torchs_threads(monkeypatch):
    """SecureRandom(threads=3) draws on 3 threads where torch has 1 (torchrun's default), the same values as on 1;
    --noise-threads is refused without --secure-noise, and must be a positive integer."""
    import threading

    import prismdp.privacy.secure as secure
    from prismdp.train.config import ConfigError, TrainConfig

    monkeypatch.setattr(secure, "BLOCK", 1000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = SecureRandom(KEY, threads=1).normal((10_007,), torch.float32, "cpu")
        gen = SecureRandom(KEY, threads=3)
        three = gen.normal((10_007,), torch.float32, "cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)
    assert gen._pool_size == 3
    assert sum(t.name.startswith("prismdp-secure-noise") for t in threading.enumerate()) >= 3
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="threads"):
            SecureRandom(KEY, threads=bad)
    with pytest.raises(ConfigError, match="noise_threads.*--secure-noise"):
        TrainConfig(noise_threads=4)
    with pytest.raises(ConfigError, match="noise_threads"):
        TrainConfig(noise_threads=0, secure_noise=True)
    assert TrainConfig(noise_threads=4, secure_noise=True).noise_threads == 4


def test_secure_streams_are_keyed_from_the_os_and_take_no_seed():
    a, b = SecureRandom().normal((64,), torch.float64, "cpu"), SecureRandom().normal((64,), torch.float64, "cpu")
    assert not torch.equal(a, b)
    for seed in (42, b"short", "x" * 32):
        with pytest.raises(ValueError, match="not a seed"):
            SecureRandom(seed)
    with pytest.raises(ValueError, match="takes no seed"):
        make_private(tiny_net(), method="dp-adamw", lr=1e-3, dataset_size=10, batch_size=2, steps=3,
                     noise_multiplier=1.0, seed=0, secure_noise=True)
    with pytest.raises(ValueError, match="noise_threads.*secure_noise=True"):
        make_private(tiny_net(), method="dp-adamw", lr=1e-3, dataset_size=10, batch_size=2, steps=3,
                     noise_multiplier=1.0, seed=0, noise_threads=2)
    private = make_private(tiny_net(), method="dp-adamw", lr=1e-3, dataset_size=10, batch_size=2, steps=3,
                           noise_multiplier=1.0, secure_noise=True, noise_threads=2)
    assert private.mechanism.noise_source.threads == 2


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


def _secure_run(method, steps=3, n=200, b=20):
    """A secure make_private run on a tiny model with torch's global generator re-seeded to 0 before the run and
    before each step's sample and noise: the Poisson batches, the noise of each release, and the report."""
    torch.manual_seed(0)
    private = make_private(tiny_net(seed=0), method=method, lr=1e-3, dataset_size=n, batch_size=b, steps=steps,
                           noise_multiplier=1.0, secure_noise=True)
    noises = []
    private.optimizer.attach_step_hook(lambda r: noises.append(torch.cat([x.flatten() for x in r.release.noise])))
    batches = []
    torch.manual_seed(0)
    for batch in private.batches():
        batches.append(batch.tolist())
        torch.manual_seed(0)
        private.step()  # an empty logical batch as far as the data go: the release is noise alone
        torch.manual_seed(0)
    return batches, noises, private.privacy_report()


@pytest.mark.parametrize("method", ["prism", "dp-adamw"])
def test_secure_inclusions_and_noise_do_not_follow_torch_seeds_and_the_report_names_chacha20_for_both(method):
    """--secure-noise: two runs with identical torch seeds (the global generator re-seeded before every draw) give
    different Poisson samples and different noise, and no two steps of one run repeat; the report reads, from the
    generators in use, ChaCha20 for the noise and for the inclusions."""
    (b1, n1, rep), (b2, n2, _) = _secure_run(method), _secure_run(method)
    assert b1 != b2  # 3 steps of 200 inclusions at q = 0.1: equal with probability ~1e-90 if independent
    for x, y in zip(n1, n2):
        assert not torch.equal(x, y)
    assert not torch.equal(n1[0], n1[1]) and b1[0] != b1[1]
    assert rep["secure_noise"] is True
    assert "ChaCha20" in rep["noise_source"]["generator"] and "Holohan" in rep["noise_source"]["gaussian"]
    assert "ChaCha20" in rep["sampling_source"]["generator"]
    plain = make_private(tiny_net(seed=0), method=method, lr=1e-3, dataset_size=200, batch_size=20, steps=3,
                         noise_multiplier=1.0, seed=0).privacy_report()
    assert plain["secure_noise"] is False  # the report reads the generators: Mersenne Twister without the flag
    assert "Mersenne" in plain["noise_source"]["generator"] and "Mersenne" in plain["sampling_source"]["generator"]


def test_secure_inclusions_and_noise_come_from_os_keys_alone(monkeypatch):
    """The converse: with the OS's key source (secrets.token_bytes) replaced by a fixed sequence of keys, two secure
    runs draw the same samples and the same noise, although nothing else is seeded -- so no other source (torch, an
    OS-drawn seed for a Mersenne Twister) feeds either."""
    import hashlib
    import secrets

    def fixed_keys():
        count = iter(range(10**6))
        return lambda n=32: hashlib.sha256(str(next(count)).encode()).digest()[:n]

    runs = []
    for seed in (1, 2):  # and torch seeded differently in the two runs
        monkeypatch.setattr(secrets, "token_bytes", fixed_keys())
        model = tiny_net(seed=0)
        torch.manual_seed(seed)
        private = make_private(model, method="dp-adamw", lr=1e-3, dataset_size=200, batch_size=20, steps=3,
                               noise_multiplier=1.0, secure_noise=True)
        noises = []
        private.optimizer.attach_step_hook(lambda r: noises.append([x.clone() for x in r.release.noise]))
        batches = []
        for batch in private.batches():
            batches.append(batch.tolist())
            torch.randn(5)  # the global generator moves between steps
            private.step()
        runs.append((batches, noises))
    (b1, n1), (b2, n2) = runs
    assert b1 == b2 and any(b1)
    assert all(torch.equal(x, y) for s, t in zip(n1, n2) for x, y in zip(s, t))


def test_a_secure_private_trainer_ignores_its_seed_for_samples_and_noise(tiny_bert_dir, tmp_path):
    """PrivateTrainer(secure_noise=True): the Trainer's seed seeds the model only; two trainers with the same
    TrainingArguments (seed 3) train on different Poisson samples with different noise, and say ChaCha20 for both."""
    from transformers import TrainingArguments

    from helpers import tiny_bert_cls
    from prismdp.data.collate import pad_collate
    from prismdp.integrations.hf import PrivacyArguments, PrivateTrainer

    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(1, 100, (6,), generator=g).tolist(), "labels": i % 2, "row": i}
            for i in range(64)]

    def run(out):
        seen, noises = [], []
        collate = lambda batch: (seen.append(sorted(r["row"] for r in batch)), pad_collate(batch, 0))[1]  # noqa
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=64, learning_rate=1e-3,
                                 max_steps=4, seed=3, report_to=[], save_strategy="no", remove_unused_columns=False,
                                 use_cpu=True, disable_tqdm=True)
        trainer = PrivateTrainer(model=tiny_bert_cls(), args=args, train_dataset=rows, data_collator=collate,
                                 privacy_args=PrivacyArguments(method="dp-adamw", noise_multiplier=1.0,
                                                               expected_batch_size=16, secure_noise=True))
        trainer.private.optimizer.attach_step_hook(lambda r: noises.append(r.release.noise[0].clone()))
        trainer.train()
        return seen, noises, trainer.privacy_report()

    (s1, n1, rep), (s2, n2, _) = run(tmp_path / "a"), run(tmp_path / "b")
    assert len(n1) == len(n2) == 4 and s1 != s2
    assert all(not torch.equal(x, y) for x, y in zip(n1, n2))
    assert rep["secure_noise"] is True and "ChaCha20" in rep["sampling_source"]["generator"]
    assert "ChaCha20" in rep["noise_source"]["generator"]


def test_background_secure_noise_equals_the_foreground_draw_bit_for_bit(monkeypatch):
    """The next release's noise drawn on a background thread (``background=True``) is, bit for bit, what the
    foreground draws for the same key: same draw numbers, same blocks, whatever the timing; shapes that change
    between releases drop the prefetched draw and draw again under the same numbers; the draw counter (the
    keystream position a checkpoint or a copy would carry) after each release is the foreground's."""
    import prismdp.privacy.secure as secure

    monkeypatch.setattr(secure, "BLOCK", 1000)  # several blocks per tensor, on the pool's threads
    specs = [((3, 700), torch.float32, "cpu"), ((2500,), torch.float64, "cpu")]
    other = [((40,), torch.float32, "cpu")]
    plan = [specs, specs, other, specs, specs]
    fg, bg = SecureRandom(KEY, threads=2, background=False), SecureRandom(KEY, threads=2, background=True)
    for i, release in enumerate(plan):
        want = [fg.normal(*spec) for spec in release]  # the foreground: one draw per tensor, in order
        got = bg.normals(release)
        assert [g.dtype for g in got] == [w.dtype for w in want]
        assert all(torch.equal(g, w) for g, w in zip(got, want)), i
        assert bg._draws == fg._draws and bg.state_dict() == fg.state_dict()
        assert bg._pending is not None and bg._pending[0] == [(tuple(s), d, torch.device(v)) for s, d, v in release]
        assert copy.deepcopy(bg)._draws == fg._draws  # a copy carries the position, not the pending draw
    assert fg._pending is None
    # the background draw really is what is served: a pending draw, planted with other values, comes back
    planted = bg._pending[1].result()
    planted[0].fill_(7.0)
    assert torch.equal(bg.normals(specs)[0], torch.full((3, 700), 7.0))
