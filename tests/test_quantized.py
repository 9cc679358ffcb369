"""A quantized base (QLoRA, issue 27): bitsandbytes' CPU backend carries these tests (bitsandbytes >= 0.48).

The reference for a quantized model is the same model with every quantized weight replaced by its de-quantized value
in an ordinary float32 ``nn.Linear`` (what the quantized layer multiplies by): per-example gradients, the rank-r
start and the exported adapter must agree with it."""

import copy
import json
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("bitsandbytes")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from prismdp.export import export_adapter  # noqa: E402
from prismdp.grad_sample import GradSampler  # noqa: E402
from prismdp.lora import LoraSetupError, find_lora_pairs, move_to_rank_r_start, quantized_base  # noqa: E402
from prismdp.losses import causal_lm_losses  # noqa: E402
from prismdp.models import ModelLoadError, load_model, quantize_linear_layers  # noqa: E402
from prismdp.quantized import nf4_scaler_block_size, quantize_nf4_layers, to_nf4_weight  # noqa: E402
from prismdp.train.config import ConfigError, TrainConfig  # noqa: E402

TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def tiny_llama(layers=2, hidden=64, inter=128, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def dequantize(layer):
    """bitsandbytes' functional de-quantization of a Linear4bit / Linear8bitLt weight (before its first forward)."""
    import bitsandbytes.functional as F

    w = layer.weight
    if w.__class__.__name__ == "NF4Tensor":  # torchao's own de-quantization
        return w.get_original_weight()
    if w.__class__.__name__ == "Params4bit":
        return F.dequantize_4bit(w.data, w.quant_state)
    return w.data.float() * w.SCB.float().unsqueeze(1) / 127  # LLM.int8: row-wise absmax scales


def quantized_and_reference(float_model, kind):
    """(the model quantized, the same model in float32 with every quantized weight de-quantized)."""
    q = copy.deepcopy(float_model)
    if kind == "nf4":
        names, left = quantize_nf4_layers(q.requires_grad_(False), keep={"lm_head"})
        assert not left
    else:
        names = quantize_linear_layers(q, kind)
    ref = copy.deepcopy(float_model)
    for name in names:
        ref.get_submodule(name).weight.data.copy_(dequantize(q.get_submodule(name)).float())
    return q, ref, names


def lora(model, dropout=0.0):
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=TARGETS))


def batch(n=3, t=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (n, t), generator=g)
    mask = torch.ones(n, t, dtype=torch.long)
    mask[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def per_example(model, pairs, b):
    sampler = GradSampler(model, pairs)
    with sampler.record() as rec:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        causal_lm_losses(logits, b["labels"]).sum().backward()
    grads = sampler.grads(rec)
    sampler.close()
    return [(gb.clone(), ga.clone()) for gb, ga in grads.lora]


def stored(weight):
    """What a quantized weight stores (NF4: its 4-bit codes; bitsandbytes: its packed data)."""
    return (weight.quantized_data if weight.__class__.__name__ == "NF4Tensor" else weight.data).clone()


@pytest.mark.parametrize("kind, tol", [("4bit", 1e-5), ("8bit", 2e-2), ("nf4", 1e-5)])
def test_per_example_gradients_equal_those_of_the_dequantized_float32_model(kind, tol):
    """After PRISM's rank-r start (computed from the de-quantized W0 and kept in the LoRA branch), a quantized-base
    model computes the function of its de-quantized float32 twin and has its per-example gradients: to 1e-5 relative
    at 4 bits (bitsandbytes' CPU 4-bit matmul de-quantizes to float32; torchao's NF4 too), 2e-2 at 8 bits (LLM.int8
    computes the base product in float16 on CPU).  The quantized weights are never rewritten."""
    if kind == "nf4":
        pytest.importorskip("torchao")
    base = tiny_llama()
    q, ref, names = quantized_and_reference(base, kind)
    assert len(names) == 2 * 7  # q/k/v/o/gate/up/down of both blocks; lm_head stays float
    q, ref = lora(q), lora(ref)
    qp, rp = find_lora_pairs(q), find_lora_pairs(ref)
    assert all(quantized_base(p) == kind for p in qp) and not any(quantized_base(p) for p in rp)
    packed = {p.name: stored(p.layer.get_base_layer().weight) for p in qp}
    b = batch()
    with torch.no_grad():
        before = q(input_ids=b["input_ids"]).logits
    sq, sr = move_to_rank_r_start(qp), move_to_rank_r_start(rp)
    for (a0, b0), (c0, d0) in zip(sq.factors, sr.factors):  # the same Z0 from the de-quantized W0
        torch.testing.assert_close(a0 @ b0.T, c0 @ d0.T, rtol=1e-6, atol=1e-6)
    for p, r in zip(qp, rp):  # and the same factors (an SVD's column signs are free: the gauge of Z0 = A0 B0^T)
        for w, v in zip(r.params, p.params):
            w.data.copy_(v.data)
    for p in qp:
        assert torch.equal(stored(p.layer.get_base_layer().weight), packed[p.name])
    with torch.no_grad():
        after, want = q(input_ids=b["input_ids"]).logits, ref(input_ids=b["input_ids"]).logits
    scale = float(want.abs().max())
    assert float((after - before).abs().max()) < 1e-4 * scale  # the start left the function unchanged
    assert float((after - want).abs().max()) < max(tol, 1e-5) * scale
    for (gq, aq), (gr, ar) in zip(per_example(q, qp, b), per_example(ref, rp, b)):
        for x, y in ((gq, gr), (aq, ar)):
            assert x.shape[0] == 3
            assert float((x - y).abs().max()) <= tol * float(y.abs().max())


def test_the_original_float_model_differs_by_the_quantization_error():
    """The de-quantized reference above is not the float model: the comparison sees the quantization."""
    base = tiny_llama()
    q, ref, _ = quantized_and_reference(base, "4bit")
    ids = batch()["input_ids"]
    with torch.no_grad():
        a, b, c = q(input_ids=ids).logits, ref(input_ids=ids).logits, base(input_ids=ids).logits
    assert float((a - b).abs().max()) < 1e-5 * float(b.abs().max())
    assert float((c - b).abs().max()) > 1e-3 * float(b.abs().max())


def test_dropout_compensation_ablation_is_refused_on_a_quantized_base():
    q = lora(quantized_and_reference(tiny_llama(), "4bit")[0], dropout=0.1)
    start = move_to_rank_r_start(find_lora_pairs(q))
    with pytest.raises(LoraSetupError, match="quantized base"):
        start.dropout_compensation.remove()


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created inside the mode and still alive, checked after every aten op: a
    memory measurement of what a computation holds at once (CPU has no allocator statistics to ask)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[weakref.ref, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = (weakref.ref(t), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if v[0]() is not None}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def test_rank_r_start_holds_one_de_quantized_layer_at_a_time():
    """The rank-r start of a 6-block 4-bit model holds at most about one layer's float64 copy (plus its SVD) at once:
    its peak live tensor memory (measured: about 5 such layers: the float32 de-quantization, its float64 copy, the SVD's
    input copy and factors) stays below 8 x the largest layer in float64, where de-quantizing the whole model first
    would hold 24 of them."""
    q = lora(quantized_and_reference(tiny_llama(layers=8, hidden=96, inter=192), "4bit")[0])
    pairs = find_lora_pairs(q)
    layer = max(m * n for m, n, _ in (p.shape for p in pairs)) * 8
    whole = sum(m * n for m, n, _ in (p.shape for p in pairs)) * 8
    with LiveTensorBytes() as mem:
        move_to_rank_r_start(pairs)
    assert whole >= 24 * layer
    assert mem.peak < 8 * layer, (mem.peak, layer, whole)


def test_exported_adapter_loads_on_the_quantized_and_on_the_original_base(tmp_path):
    """The rank-2r adapter of a started, updated 4-bit model: with stock PEFT on the same base quantized again it
    reproduces the trained model; on the original float base it differs by the de-quantization error alone (the
    same difference as between the two bases without adapter)."""
    base = tiny_llama()
    q = lora(quantize_linear_layers_copy(base), dropout=0.1)
    pairs = find_lora_pairs(q)
    start = move_to_rank_r_start(pairs)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a trained update
        for p in pairs:
            for w in p.params:
                w.add_(0.05 * torch.randn(w.shape, generator=g))
    export_adapter(q, pairs, start, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 8
    ids = batch()["input_ids"]
    on_q = PeftModel.from_pretrained(quantize_linear_layers_copy(base), tmp_path / "adapter").eval()
    on_float = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "adapter").eval()
    q.eval()
    with torch.no_grad():
        want = q(input_ids=ids).logits
        got_q, got_f = on_q(input_ids=ids).logits, on_float(input_ids=ids).logits
        with on_q.disable_adapter(), on_float.disable_adapter():
            base_gap = float((on_q(input_ids=ids).logits - on_float(input_ids=ids).logits).abs().max())
            plain = on_q(input_ids=ids).logits
    scale = float(want.abs().max())
    assert float((got_q - want).abs().max()) < 1e-4 * scale
    assert float((plain - want).abs().max()) > 1e-2 * scale  # the adapter carries a real update
    gap = float((got_f - want).abs().max())
    assert 0.5 * base_gap < gap < 2 * base_gap, (gap, base_gap)


def quantize_linear_layers_copy(model, kind="4bit"):
    q = copy.deepcopy(model)
    quantize_linear_layers(q, kind)
    return q


def test_quantize_is_validated_and_a_missing_bitsandbytes_names_the_fix(monkeypatch):
    with pytest.raises(ConfigError, match="quantize"):
        TrainConfig(quantize="3bit")
    assert TrainConfig(quantize="4bit").quantize == "4bit"
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)
    with pytest.raises(ModelLoadError, match="pip install 'bitsandbytes"):
        load_model(None, "causal_lm", quantize="4bit")


def test_a_bitsandbytes_without_cpu_backend_names_the_fix(monkeypatch):
    import bitsandbytes

    monkeypatch.setattr(bitsandbytes, "__version__", "0.42.0")
    with pytest.raises(ModelLoadError, match="no CPU backend.*--upgrade"):
        load_model(None, "causal_lm", quantize="4bit", device="cpu")


@pytest.mark.slow
def test_prism_on_a_4bit_smollm2_trains_accounts_like_bf16_and_exports_an_adapter(tmp_path):
    """prismdp train --quantize 4bit on the packaged SmolLM2-135M (PRISM, epsilon 8, a few steps): the loss on its
    training examples falls from the start's (the adapter switched off is the quantized base itself: the start sits in
    the LoRA branch), privacy.json equals the bfloat16 run's, and the rank-2r adapter loads with stock PEFT on the
    4-bit base and reproduces the trained model."""
    from prismdp.data.collate import pad_collate
    from prismdp.models import default_causal_lm
    from prismdp.train.loop import train
    from prismdp.train.tasks import build_task_data

    try:
        default_causal_lm()
    except ModelLoadError as e:
        pytest.skip(str(e))
    records = [{"instruction": f"Add {i} and {i + 1}.", "input": "", "output": f"The answer is {2 * i + 1}."}
               for i in range(48)]
    (tmp_path / "data.json").write_text(json.dumps(records))
    common = dict(model=None, task="instruct", data=str(tmp_path / "data.json"), steps=3, batch_size=16,
                  micro_batch_size=16, max_length=64, rank=4, alpha=8, lr=1e-2, epsilon=8.0, dropout=0.05,
                  target_modules=["q_proj", "v_proj"])
    quiet = {"log": lambda *a, **k: None}
    cfg = TrainConfig(output=str(tmp_path / "q4"), quantize="4bit", **common)
    res = train(cfg, **quiet)
    model = res.model.eval()
    assert all(quantized_base(p) == "4bit" for p in find_lora_pairs(model))
    examples = build_task_data(cfg, res.tokenizer).train[:16]  # the run's own training examples (prompt + answer)
    b = pad_collate([{"input_ids": f["input_ids"], "labels": f["labels"]} for f in examples],
                    res.tokenizer.pad_token_id)

    def loss():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        return float(causal_lm_losses(logits, b["labels"]).mean())

    with torch.no_grad():
        after = loss()
        with model.disable_adapter():
            before = loss()
        want = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert after < before - 0.05, (before, after)
    train(TrainConfig(output=str(tmp_path / "bf16"), dtype="bfloat16", **common), **quiet)
    q4, bf16 = (json.loads((tmp_path / n / "privacy.json").read_text()) for n in ("q4", "bf16"))
    assert q4 == bf16 and q4["private"] and q4["epsilon"] <= 8.0
    base, _ = load_model(None, "causal_lm", quantize="4bit")
    loaded = PeftModel.from_pretrained(base, tmp_path / "q4" / "adapter").eval()
    with torch.no_grad():
        got = loaded(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.isfinite(got).all() and got.shape == want.shape  # it loads; whether it reproduces: the test below


@pytest.mark.slow
def test_the_exported_adapter_reproduces_a_4bit_smollm2_on_a_fresh_4bit_base(tmp_path):
    """Was a defect: an evaluation (eval mode, no gradients) let bitsandbytes' CPU backend repack the 4-bit weights
    for its bf16 kernel, which turned rounding-level differences between the trained and the exported adapter into
    0.28 of logits up to 35 (see test_an_evaluation_leaves_a_4bit_base_computing_what_it_trains)."""
    from prismdp.engine import make_private
    from prismdp.models import default_causal_lm

    try:
        default_causal_lm()
    except ModelLoadError as e:
        pytest.skip(str(e))
    base, _ = load_model(None, "causal_lm", quantize="4bit")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))
    private = make_private(model, method="prism", lr=1e-2, dataset_size=100, batch_size=10, steps=10,
                           noise_multiplier=1.0, seed=0)
    model.eval()
    ids = torch.tensor([[1, 500, 600, 700, 800, 900]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    export_adapter(model, private.pairs, private.start, tmp_path / "adapter")
    fresh, _ = load_model(None, "causal_lm", quantize="4bit")
    loaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert float((got - want).abs().max()) < 1e-3 * float(want.abs().max())


def _has_avx512bf16():
    from bitsandbytes.functional import has_avx512bf16

    return has_avx512bf16()


@pytest.mark.skipif(not _has_avx512bf16(), reason="bitsandbytes repacks 4-bit weights for its bf16 CPU kernel only on "
                    "CPUs with AVX512-BF16")
@pytest.mark.parametrize("how", ["load_model", "user's model + make_private"])
def test_an_evaluation_leaves_a_4bit_base_computing_what_it_trains(tiny_llama_dir, how):
    """bitsandbytes' CPU backend repacks a Linear4bit's weight at its first forward in eval mode without gradients
    (bf16 block scales, another layout).  After an evaluation, a quantized base layer of a prismdp model must still
    compute x W0^T with W0 = lora.base_weight (bitsandbytes' de-quantization), in eval and in training, and its
    backward must give g W0.  Checked against W0 de-quantized before anything ran."""
    from prismdp.engine import make_private
    from prismdp.lora import base_weight

    model, _ = load_model(tiny_llama_dir, "causal_lm", quantize="4bit")
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    pairs = find_lora_pairs(peft)
    layers = [pair.layer.get_base_layer() for pair in pairs]
    if how != "load_model":  # as a model loaded with transformers' BitsAndBytesConfig leaves its layers
        for layer in layers:
            layer.support_avx512bf16_for_cpu = True
        make_private(peft, method="prism", lr=1e-2, dataset_size=100, batch_size=10, steps=2, noise_multiplier=1.0,
                     seed=0)
    before = [dequantize(layer).double() for layer in layers]
    peft.eval()
    with torch.no_grad():  # an evaluation
        peft(input_ids=torch.tensor([[1, 5, 9, 13]]))
    peft.train()
    torch.manual_seed(0)
    for pair, layer, w0 in zip(pairs, layers, before):
        assert torch.equal(base_weight(pair), w0), pair.name
        x = torch.randn(3, w0.shape[1], requires_grad=True)
        g = torch.randn(3, w0.shape[0])
        y = layer(x)
        y.backward(g)
        scale = float(w0.abs().max())
        assert float((y.double() - x.detach().double() @ w0.T).abs().max()) < 1e-5 * scale, pair.name
        assert float((x.grad.double() - g.double() @ w0).abs().max()) < 1e-5 * scale, pair.name
        layer.eval()
        with torch.no_grad():
            assert float((layer(x.detach()).double() - x.detach().double() @ w0.T).abs().max()) < 1e-5 * scale


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_a_model_folder_is_quantized_while_loading_and_gets_peft_bnb_lora_layers(tiny_llama_dir, kind):
    """load_model(folder, quantize=...) goes through transformers' BitsAndBytesConfig; PEFT then wraps the quantized
    layers in its bitsandbytes LoRA layers, which find_lora_pairs accepts."""
    import bitsandbytes as bnb

    model, _ = load_model(tiny_llama_dir, "causal_lm", quantize=kind)
    cls = bnb.nn.Linear4bit if kind == "4bit" else bnb.nn.Linear8bitLt
    assert isinstance(model.model.layers[0].self_attn.q_proj, cls)
    assert type(model.lm_head) is nn.Linear
    pairs = find_lora_pairs(lora(model))
    assert len(pairs) == 2 * 4 and all(quantized_base(p) == kind for p in pairs)


# --- torchao's NF4 (the 4-bit base that FSDP shards: --quantize 4bit --fsdp) ---------------------------------------

def test_torchaos_nf4_is_the_nf4_of_bitsandbytes():
    """The two NF4 implementations, independent of each other, agree: de-quantized values relative to their block's
    absmax equal within 0.02 (the scales' own 8-bit quantization) at all but 0.1 % of the weights (a code flipped at a
    rounding boundary); the NF4 error itself is 50x larger than their mean difference."""
    pytest.importorskip("torchao")
    import bitsandbytes.functional as F

    torch.manual_seed(0)
    w = torch.randn(256, 512) * 0.02
    ours = to_nf4_weight(w).get_original_weight()
    packed, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    theirs = F.dequantize_4bit(packed, state)
    absmax = w.reshape(-1, 64).abs().amax(1, keepdim=True)
    rel = ((ours - theirs).reshape(-1, 64) / absmax).abs()
    assert float((rel > 0.02).float().mean()) < 1e-3
    assert float((ours - w).abs().mean()) > 50 * float((ours - theirs).abs().mean())


@pytest.mark.parametrize("shape, world, size", [
    ((4096, 4096), 8, 256),  # an 8B model's attention: QLoRA's default groups of 256 scales
    ((576, 576), 1, 64),     # SmolLM2: 5184 blocks = 2^6 * 81
    ((576, 576), 2, 32),     # ... 81 groups of 64 cannot be halved: groups of 32 (162)
    ((192, 576), 2, 32),     # 1728 blocks = 2^6 * 27
    ((32, 32), 2, 8),        # 16 blocks
    ((48, 2), 1, None),      # 96 weights: not whole blocks of 64
    ((64, 64), 128, None),   # 64 blocks cannot make 128 shards
])
def test_nf4_scale_groups_fit_the_shards(shape, world, size):
    numel = shape[0] * shape[1]
    assert nf4_scaler_block_size(numel, world) == size
    if size is not None:
        blocks = numel // 64
        assert blocks % size == 0 and (blocks // size) % world == 0


def test_nf4_layers_leave_heads_trained_and_odd_shapes_in_float():
    pytest.importorskip("torchao")
    from prismdp.quantized import is_nf4

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 3), nn.Linear(64, 128)).requires_grad_(False)
    model[2].requires_grad_(True)
    done, left = quantize_nf4_layers(model, keep={"1"})
    assert (done, left) == (["0"], [])
    assert is_nf4(model[0].weight) and not is_nf4(model[1].weight) and not is_nf4(model[2].weight)
    odd = nn.Sequential(nn.Linear(6, 5)).requires_grad_(False)
    assert quantize_nf4_layers(odd) == ([], ["0"])


def test_fsdp_refuses_bitsandbytes_weights_and_8bit_and_names_the_fix(monkeypatch):
    """FSDP cannot shard bitsandbytes' packed weights: shard_frozen_base says so (before any collective) and names the
    NF4 route; --fsdp --quantize 8bit is refused before anything is loaded; --fsdp --quantize 4bit without torchao
    names the install."""
    from prismdp.sharding import ShardingError, shard_frozen_base
    from prismdp.train.build import build_run

    q = lora(quantized_and_reference(tiny_llama(), "4bit")[0])
    with pytest.raises(ShardingError, match="bitsandbytes-quantized.*quantize='nf4'"):
        shard_frozen_base(q, None)
    world = type("World", (), {"size": 2, "rank": 0})()
    with pytest.raises(ConfigError, match="8bit.*--quantize 4bit"):
        build_run(TrainConfig(task="instruct", fsdp=True, quantize="8bit"), world=world)
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)
    monkeypatch.setitem(__import__("sys").modules, "torchao.quantization", None)
    with pytest.raises(ConfigError, match="pip install 'torchao"):
        build_run(TrainConfig(task="instruct", fsdp=True, quantize="4bit"), world=world)


@pytest.mark.parametrize("kind", ["4bit", "8bit"])
def test_the_new_classification_head_of_a_quantized_encoder_stays_float_and_trains(tiny_bert_dir, kind):
    """Issue 42, defect 1: ``prismdp train --quantize 4bit|8bit`` on a sequence-classification checkpoint with its own
    head (the default encoder task).  The new head, which PEFT trains whole (``modules_to_save``), must stay an
    ordinary float ``nn.Linear``, as QLoRA keeps it (bitsandbytes' ``llm_int8_skip_modules``); transformers' own
    default skips miss it (the last parameter is ``classifier.bias``), so the head was quantized and make_private
    refused it as untrainable.  Checked with the private run being built; failed before the fix (Linear4bit /
    Linear8bitLt head)."""
    from prismdp.engine import make_private

    model, _ = load_model(tiny_bert_dir, "seq_cls", num_labels=3, quantize=kind)
    assert type(model.classifier) is nn.Linear and model.classifier.weight.dtype == torch.float32
    assert quantized_base(find_lora_pairs(get_peft_model(copy.deepcopy(model), LoraConfig(
        r=2, target_modules=["query"])))[0]) == kind  # the encoder itself is quantized
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["query", "value"], task_type="SEQ_CLS"))
    private = make_private(peft, lr=1e-3, dataset_size=64, batch_size=8, steps=1, seed=0)
    assert private is not None


def test_quantize_linear_layers_keeps_a_nested_head_whole():
    """The GGUF path (layers quantized after loading): a head named in ``skip`` stays float with all its layers (a
    RoBERTa-style ``classifier.dense`` / ``classifier.out_proj``), not only a layer of exactly that name."""
    from transformers import RobertaConfig, RobertaForSequenceClassification

    torch.manual_seed(0)
    model = RobertaForSequenceClassification(RobertaConfig(
        vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, num_labels=2))
    replaced = quantize_linear_layers(model, "4bit", skip=("classifier",))
    assert replaced and not any("classifier" in n for n in replaced)
    assert type(model.classifier.dense) is nn.Linear and type(model.classifier.out_proj) is nn.Linear
