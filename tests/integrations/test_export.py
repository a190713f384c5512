import copy
import math

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from torch import nn

from lst_lightning.integrations import SphericalSampling, export_dense_head, factor_lm_head, sampling_logits
from lst_lightning.integrations.hf import dense_lm_head
from lst_lightning.losses import make_loss

from .conftest import VOCAB, batch, tiny


def trained(family, loss="zloss", steps=3, **head_kwargs):
    model = factor_lm_head(tiny(family), loss=loss, lr=0.5, **head_kwargs)
    model.train()
    ids, mask, labels = batch()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
    return model.eval()


def test_export_writes_w_and_restores_the_class_forward(family):
    model = trained(family)
    head = model.lm_head
    W = head.weight().clone()
    ids, mask, _ = batch()
    with torch.no_grad():
        patched = model(input_ids=ids, attention_mask=mask).logits
    export_dense_head(model)
    assert type(model.lm_head) is nn.Linear and "forward" not in vars(model)
    assert torch.equal(model.lm_head.weight, W) and model.lm_head.bias is None
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(dense, patched, atol=1e-5)
    assert set(model.state_dict()) == set(tiny(family).state_dict())  # an ordinary model's keys
    with pytest.raises(ValueError, match="no factored head"):
        export_dense_head(model)


def test_export_with_a_bias_column_makes_lm_head_bias():
    model = tiny("llama")
    model.lm_head = nn.Linear(16, VOCAB, bias=True)
    factor_lm_head(model, lr=0.5)
    W = model.lm_head.weight()
    saved = dense_lm_head(model, model.state_dict())  # what save_pretrained writes beside the factors
    export_dense_head(model)
    assert torch.equal(model.lm_head.weight, W[:, :16]) and torch.equal(model.lm_head.bias, W[:, 16])
    assert torch.equal(saved["lm_head.weight"], W[:, :16]) and torch.equal(saved["lm_head.bias"], W[:, 16])


def test_a_patched_models_own_save_pretrained_loads_as_an_ordinary_model(family, tmp_path):
    """A patched model's own ``save_pretrained`` (the Trainer's checkpoints and ``save_model()``
    too) writes the dense lm_head beside the head's factors: ``from_pretrained`` of the model's
    class loads the trained W, bit for bit ``export_dense_head``'s, and a patched model loads the
    same file strictly, the dense tensors left out, to the same state."""
    model = trained(family)
    model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path / "positional", True, dict(model.state_dict()))  # state_dict given by position
    files = safetensors.torch.load_file(tmp_path / "model.safetensors")
    ordinary = type(model).from_pretrained(tmp_path).eval()
    again = factor_lm_head(tiny(family), loss="zloss", lr=0.5)
    again.load_state_dict(files)  # strict: lm_head.weight is not refused as a key of the head's
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    ids, mask, _ = batch()
    with torch.no_grad():
        patched = model(input_ids=ids, attention_mask=mask).logits
        loaded = ordinary(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(ordinary.lm_head.weight, export_dense_head(model).lm_head.weight)
    assert torch.allclose(loaded, patched, atol=1e-5)
    assert "save_pretrained" not in vars(model)  # exported: the class's own save again
    body = {k: v for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    assert torch.equal(safetensors.torch.load_file(tmp_path / "positional" / "model.safetensors")["lm_head.weight"],
                       ordinary.lm_head.weight)
    assert dense_lm_head(factor_lm_head(tiny(family)), body) == {}  # a state without the head's: nothing to add


def test_a_patched_model_cast_after_the_patch_saves_its_dense_lm_head_in_its_new_dtype(tmp_path):
    """The dense lm_head beside the factors takes the dtype ``export_dense_head`` gives (the model's,
    cast since the patch), rounded block by block from the head's float32 W: the same bits."""
    model = trained("llama").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    saved = safetensors.torch.load_file(tmp_path / "model.safetensors")["lm_head.weight"]
    assert saved.dtype == torch.bfloat16 and torch.equal(saved, export_dense_head(model).lm_head.weight)


def test_greedy_generate_after_export_follows_the_heads_ranking(family):
    model = trained(family)
    head = model.lm_head
    ids, _, _ = batch(m=1)
    out_patched = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=VOCAB - 1, attention_mask=torch.ones_like(ids))
    H = model.base_model(input_ids=out_patched[:, :-1])[0][0]
    expected = head.scores(H.detach()).argmax(-1)[ids.shape[1] - 1:]  # the head's own ranking at each new token
    assert torch.equal(out_patched[0, ids.shape[1]:], expected)
    export_dense_head(model)
    out_dense = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=VOCAB - 1, attention_mask=torch.ones_like(ids))
    assert torch.equal(out_dense, out_patched)


@pytest.mark.parametrize("loss", ["spherical_softmax", "taylor_softmax"])
def test_sampling_logits_give_the_heads_probability(loss):
    fn = make_loss(loss)
    O = torch.randn(4, VOCAB) * 3
    p = torch.softmax(sampling_logits(fn, O), -1)
    assert torch.allclose(p.log(), fn.dense_log_prob(O).float(), atol=1e-5)


@pytest.mark.parametrize("loss", ["zloss", "mse"])
def test_losses_without_a_probability_refuse_sampling(loss):
    with pytest.raises(ValueError, match="no probability"):
        SphericalSampling(make_loss(loss))


def test_greedy_with_the_processor_ranks_by_p_not_by_o():
    model = trained("llama", loss="spherical_softmax")
    head = model.lm_head
    ids, _, _ = batch(m=1)
    H = model.base_model(input_ids=ids)[0][0, -1:].detach()
    export_dense_head(model)
    out = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=VOCAB - 1, attention_mask=torch.ones_like(ids),
                         logits_processor=[SphericalSampling(head.loss_fn)])
    assert int(out[0, -1]) == int(head.scores(H).argmax())


@pytest.mark.parametrize("cast,dtype", [(lambda m: m.to(torch.bfloat16), torch.bfloat16),
                                         (lambda m: m.half(), torch.float16), (lambda m: m.double(), torch.float64)])
def test_a_model_cast_after_the_patch_exports_an_lm_head_in_its_new_dtype(cast, dtype):
    """The exported lm_head is the original's dtype, or the model's where the model was cast
    since the patch: it took the float32 of the original lm_head, and the exported model's
    forward failed on the body's bf16 hidden states ("expected m1 and m2 to have the same dtype")."""
    model = cast(trained("llama"))
    W = model.lm_head.weight()
    export_dense_head(model)
    assert model.lm_head.weight.dtype == dtype and torch.equal(model.lm_head.weight, W.to(dtype))
    ids, mask, _ = batch()
    with torch.no_grad():
        assert model(input_ids=ids, attention_mask=mask).logits.dtype == dtype
    model = trained("llama")
    model.model.to(torch.bfloat16)  # the body alone, after the patch: the lm_head takes its hidden states' dtype
    assert export_dense_head(model).lm_head.weight.dtype == torch.bfloat16
    model = trained("llama")  # left as it was: the original lm_head's dtype
    assert export_dense_head(model).lm_head.weight.dtype == torch.float32


def test_an_exported_model_saves_and_loads_as_an_ordinary_one(tmp_path):
    model = export_dense_head(trained("qwen2"))
    model.save_pretrained(tmp_path)
    again = type(model).from_pretrained(tmp_path).eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        a, b = model(input_ids=ids, attention_mask=mask).logits, again(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again.lm_head.weight, model.lm_head.weight) and torch.allclose(a, b, atol=1e-6)



@pytest.mark.parametrize("preconditioner", [None, {}])
def test_sampled_classes_train_logits_the_exported_models_held_out_perplexity_falls(preconditioner):
    """loss="sampled" trains o as logits: the exported model is an ordinary one whose
    distribution is softmax(o) (SphericalSampling leaves o as it is), so generate() samples
    from it as from any model. Its perplexity on held-out text (the +1 rule, other starts)
    is finite and falls with training; with the right preconditioner (lst-train's default) too."""
    def text(starts):  # token t + 1 follows token t
        return (starts[:, None] + torch.arange(12)[None, :]) % VOCAB

    g = torch.Generator().manual_seed(0)
    held_out = text(torch.arange(0, VOCAB, 5))
    model = factor_lm_head(tiny("llama"), loss="sampled", negatives=dict(num=8, seed=0), lr=0.5,
                           preconditioner=preconditioner)
    loss_fn = model.lm_head.loss_fn

    def perplexity():
        dense = export_dense_head(copy.deepcopy(model)).eval()
        with torch.no_grad():
            logits = dense(input_ids=held_out).logits[:, :-1]
        return float(F.cross_entropy(logits.reshape(-1, VOCAB), held_out[:, 1:].reshape(-1)).exp())

    before = perplexity()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(40):
        ids = text(torch.randint(0, VOCAB, (8,), generator=g))
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    after = perplexity()
    assert math.isfinite(after) and after < 0.5 * before, (before, after)
    scores = torch.randn(2, VOCAB)
    assert torch.equal(SphericalSampling(loss_fn)(held_out[:2], scores), scores)  # softmax(o): o as it is
    dense = export_dense_head(model).eval()
    prompt = held_out[:1, :4]
    out = dense.generate(prompt, max_new_tokens=4, do_sample=True, pad_token_id=VOCAB - 1,
                         attention_mask=torch.ones_like(prompt), logits_processor=[SphericalSampling(loss_fn)])
    assert out.shape == (1, 8) and ((0 <= out) & (out < VOCAB)).all()
