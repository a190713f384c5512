"""litgpt's GPT with the factored head (factor_gpt_head): tiny random-init models of the
real class, trained by Fabric and Lightning loops, exported back to an ordinary GPT."""
import importlib
import warnings

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.precision import MixedPrecision
from litgpt import GPT, Config
from litgpt.generate.base import generate
from litgpt.utils import chunked_cross_entropy
from round_trips import COPIES
from torch import nn

from lst_lightning.app.callbacks.head_steps import HeadSteps
from lst_lightning.integrations import export_dense_head, factor_gpt_head, factored_head, sampling_logits
from lst_lightning.spherical import NaiveSphericalHead

from head_pairs import rel

VOCAB, PADDED, HIDDEN, T = 40, 48, 16, 12


TINY = dict(name="tiny", block_size=32, vocab_size=VOCAB, padded_vocab_size=PADDED, n_layer=1, n_head=2, n_embd=HIDDEN,
            rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
            mlp_class_name="LLaMAMLP", intermediate_size=32)


def tiny_gpt(bias: bool = False, **over) -> GPT:
    torch.manual_seed(0)
    config = Config(**{**TINY, "lm_head_bias": bias, **over})
    model = GPT(config)
    if bias:
        nn.init.normal_(model.lm_head.bias, std=0.1)
    return model


def rows(m: int = 3, seed: int = 1, padded: slice = slice(0, 1)):
    """litgpt's (input_ids, targets): targets already shifted, -100 on the ``padded`` rows' last
    4 tokens, tokens repeating."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB // 4, (m, T + 1), generator=g)
    ids, targets = data[:, :-1], data[:, 1:].clone()
    targets[padded, -4:] = -100
    return ids, targets


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("bias", [False, True])
def test_logits_before_training_are_the_original_models(bias):
    model = tiny_gpt(bias)
    ids, _ = rows()
    with torch.no_grad():
        before = model(ids)
        factor_gpt_head(model)
        after = model(ids)
        chunks = model(ids, lm_head_chunk_size=5)
    assert factored_head(model).num_classes == PADDED and isinstance(model.lm_head, nn.Identity)
    assert after.shape == (3, T, PADDED) and torch.allclose(before, after, atol=1e-5)
    assert [c.shape[1] for c in chunks] == [5, 5, 2] and torch.equal(torch.cat(chunks, 1), after)


@pytest.mark.parametrize("loss", ["zloss", "spherical_softmax", "taylor_softmax", "mse", "sampled"])
def test_a_training_step_matches_the_explicit_w_reference(loss):
    """The patched GPT's loss, dL/dH and step equal the naive head's (explicit W: the
    lm_head weight and bias column) on the same hidden states, float64, litgpt's alignment;
    with sampled classes inside the step (loss=sampled), on the same draws."""
    kw = {"negatives": {"num": 8, "seed": 3}} if loss == "sampled" else {}
    model = tiny_gpt(bias=True).double()
    W = torch.cat([model.lm_head.weight, model.lm_head.bias[:, None]], 1).detach().clone()
    factor_gpt_head(model, loss=loss, lr=0.3, **kw)
    naive = NaiveSphericalHead(PADDED, HIDDEN, loss=loss, lr=0.3, bias=True, reduction="mean_real",
                               dtype=torch.float64, **kw)
    naive.reset_weight(W)
    ids, targets = rows()
    seen = []
    model.transformer.ln_f.register_forward_hook(lambda m, a, o: seen.append(o) or o.retain_grad())
    out = model(ids, targets=targets)
    out.backward()
    H = seen[0].detach().reshape(-1, HIDDEN).clone().requires_grad_()
    ref = naive(H, targets.reshape(-1))
    ref.backward()
    assert torch.allclose(out, ref, rtol=1e-10)
    assert torch.allclose(seen[0].grad.reshape(-1, HIDDEN), H.grad, rtol=1e-9, atol=1e-12)
    assert torch.allclose(factored_head(model).weight(), naive.weight(), rtol=1e-9, atol=1e-12)
    assert not torch.allclose(naive.weight(), W)


@pytest.mark.parametrize("loss", ["spherical_softmax", "sampled"])
def test_the_loss_is_the_dense_heads_on_the_same_outputs_as_litgpt_computes_it(loss):
    """The Z-loss on o is litgpt's chunked_cross_entropy's convention: the mean over the
    real targets; for the losses with a probability, its -log p on the exported logits in
    evaluation (``sampled``: softmax(o)'s, over all D classes, not its spherical terms alone)."""
    model = factor_gpt_head(tiny_gpt(), loss=loss)
    ids, targets = rows()
    model.eval()
    with torch.no_grad():
        loss = model(ids, targets=targets)
        o = model(ids)
        nll = chunked_cross_entropy(sampling_logits(factored_head(model).loss_fn, o).double(), targets)
    assert torch.allclose(loss.double(), nll, rtol=1e-5)


def fabric_run(batch: int, accumulate: int, steps: int = 3, precision="64-true"):
    if precision == "16-mixed":  # Fabric's fp16 with its GradScaler (on the CPU only as a plugin)
        fabric = L.Fabric(accelerator="cpu", devices=1,
                          plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    else:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
    model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5, dtype=torch.float64 if precision == "64-true" else
                            torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    head = factored_head(model.module)
    head.attach(optimizer)  # the Fabric-wrapped optimizer: one head step per optimizer step, with its scaler
    assert head.pending.scaler is getattr(fabric.strategy.precision, "scaler", None)
    # every row padded alike: litgpt's loss / accumulate is then the batch's mean over real tokens
    ids, targets = rows(m=batch * accumulate * steps, seed=3, padded=slice(None))
    losses = []
    for s in range(steps):
        for k in range(accumulate):
            i = slice((s * accumulate + k) * batch, (s * accumulate + k + 1) * batch)
            with fabric.no_backward_sync(model, enabled=k < accumulate - 1):
                loss = model(ids[i], targets=targets[i])
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    head.detach()
    return model.module, losses


def test_a_fabric_loop_accumulates_exactly():
    """litgpt's own loop shape (fabric.backward(loss / accumulate), no_backward_sync): two
    micro-batches per step give the model that whole batches give, body and head."""
    whole, _ = fabric_run(batch=4, accumulate=1)
    halves, _ = fabric_run(batch=2, accumulate=2)
    assert int(factored_head(halves).steps) == 3
    a, b = state(whole), state(halves)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-9, atol=1e-12) for k in a)


def test_a_fabric_loop_under_fp16_divides_its_scalers_scale_out_of_the_head_step():
    """Under Fabric's 16-mixed, ``fabric.backward`` multiplies the loss by its GradScaler's scale:
    ``attach(optimizer)`` takes that scaler from Fabric's optimizer, so the head steps as under
    32-true (a head not given it steps 65 536 times too far)."""
    ref, _ = fabric_run(batch=2, accumulate=2, steps=4, precision="32-true")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*multiplied by")
        model, _ = fabric_run(batch=2, accumulate=2, steps=4, precision="16-mixed")
        factored_head(model).sync()
    assert int(factored_head(model).steps) == 4
    assert rel(factored_head(model).weight(), factored_head(ref).weight()) < 1e-4


def test_a_fabric_loop_under_bf16_mixed_lowers_the_loss():
    model, losses = fabric_run(batch=3, accumulate=1, steps=12, precision="bf16-mixed")
    assert factored_head(model).dtype == torch.float32 and all(map(torch.isfinite, map(torch.tensor, losses)))
    assert sum(losses[-3:]) < sum(losses[:3])


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5)

    def training_step(self, batch, _):
        ids, targets = batch
        loss = self.model(ids, targets=targets)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=3e-3)


def test_a_lightning_module_trains_it_one_head_step_per_optimizer_step(tmp_path):
    ids, targets = rows(m=16, seed=5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, targets), batch_size=2)
    module = LitGPT()
    before = module.model(ids, targets=targets).item()
    trainer = L.Trainer(accelerator="cpu", max_epochs=3, accumulate_grad_batches=2, callbacks=[HeadSteps()],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, loader)
    assert int(factored_head(module.model).steps) == trainer.global_step == 12
    assert module.model(ids, targets=targets).item() < before


def test_export_gives_an_ordinary_gpt_that_generates_the_heads_ranking(tmp_path):
    model = factor_gpt_head(tiny_gpt(bias=True), loss="zloss", lr=0.5)
    ids, targets = rows()
    for _ in range(3):
        model(ids, targets=targets).backward()
    model.eval()
    prompt = ids[0, :4]
    with torch.no_grad():
        o = model(ids)
    model.set_kv_cache(batch_size=1)
    greedy = generate(model, prompt, max_returned_tokens=10, top_k=1)
    export_dense_head(model)
    assert isinstance(model.lm_head, nn.Linear) and not hasattr(model, "factored_head")
    assert "forward" not in vars(model) and model.lm_head.bias is not None
    torch.save(model.state_dict(), tmp_path / "lit_model.pth")  # litgpt's checkpoint: loads into a plain GPT
    plain = tiny_gpt(bias=True)
    plain.load_state_dict(torch.load(tmp_path / "lit_model.pth"))
    plain.eval()
    with torch.no_grad():
        assert torch.allclose(plain(ids), o, atol=1e-5)
    plain.set_kv_cache(batch_size=1)
    assert torch.equal(generate(plain, prompt, max_returned_tokens=10, top_k=1), greedy)


def test_a_gpt_built_on_the_meta_device_is_patched_and_takes_a_patched_models_state_by_assign():
    """A GPT built on the meta device (as Fabric's ``init_module(empty_init=True)`` builds one for
    FSDP): patched, its head waiting there, then given a trained patched model's state by
    ``load_state_dict(assign=True)``; a meta GPT whose lm_head is wte is still refused as tied."""
    trained = factor_gpt_head(tiny_gpt())
    ids, targets = rows()
    trained(ids, targets=targets).backward()
    with torch.device("meta"):
        model, tied = tiny_gpt(), tiny_gpt()
    tied.lm_head.weight = tied.transformer.wte.weight
    with pytest.raises(ValueError, match="ties lm_head to transformer.wte"):
        factor_gpt_head(tied)
    factor_gpt_head(model)
    assert factored_head(model).device.type == "meta"
    state = {k: v.clone() for k, v in trained.state_dict().items() if torch.is_tensor(v)}
    model.load_state_dict(state, strict=False, assign=True)  # the body's meta buffers: the body's to make
    head, ref = factored_head(model), factored_head(trained)
    assert {b.device.type for b in head.buffers()} == {"cpu"}
    a, b = head.state_dict(), ref.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))


def test_tied_softcapped_and_patched_models_are_refused_unchanged():
    tied = tiny_gpt()
    tied.lm_head.weight = tied.transformer.wte.weight
    capped = tiny_gpt(final_logit_softcapping=30.0)
    twice = factor_gpt_head(tiny_gpt())
    for model, says in ((tied, "ties lm_head to transformer.wte"), (capped, "final_logit_softcapping=30.0"),
                        (twice, "already has the factored head"), (nn.Linear(2, 3), "is not a litgpt GPT")):
        before = state(model)
        with pytest.raises(ValueError, match=says):
            factor_gpt_head(model)
        after = state(model)
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="sets bias itself"):
        factor_gpt_head(tiny_gpt(), bias=True)


@pytest.mark.parametrize("variant", ["lora", "adapter_v2"])
def test_a_wrapped_lm_head_with_weights_of_its_own_is_refused_naming_it(variant):
    """litgpt.lora's GPT with LoRA on lm_head and litgpt.adapter_v2's GPT wrap lm_head's linear
    layer with weights of their own: refused in one line that names the wrapper and the way,
    nothing changed."""
    module = importlib.import_module(f"litgpt.{variant}")
    torch.manual_seed(0)
    extra = dict(lora_r=4, lora_query=True, lora_head=True) if variant == "lora" else dict(adapter_prompt_length=4)
    model = module.GPT(module.Config(**TINY, **extra))
    before = state(model)
    with pytest.raises(ValueError, match=rf"lm_head wraps its linear layer in {type(model.lm_head).__name__}") as err:
        factor_gpt_head(model)
    after = state(model)
    assert "\n" not in str(err.value) and all(torch.equal(before[k], after[k]) for k in before)


def test_a_lora_gpt_trains_its_lora_weights_and_the_head_and_exports_its_lora_linear_back():
    """litgpt.lora's GPT without LoRA on lm_head (a LoRALinear of rank 0): patched, its logits are
    the model's; your optimizer trains the LoRA weights (the rest frozen), the head takes its own
    step; export puts the LoRALinear back around a layer holding W."""
    from litgpt.lora import GPT as LoraGPT  # noqa: PLC0415
    from litgpt.lora import Config as LoraConfig
    from litgpt.lora import LoRALinear, mark_only_lora_as_trainable

    torch.manual_seed(0)
    model = LoraGPT(LoraConfig(**TINY, lora_r=4, lora_alpha=8, lora_query=True, lora_value=True))
    mark_only_lora_as_trainable(model)
    ids, targets = rows()
    with torch.no_grad():
        before = model(ids)
        factor_gpt_head(model, loss="zloss", lr=0.5)
        assert torch.allclose(model(ids), before, atol=1e-5)
    assert not isinstance(model.lm_head, LoRALinear)  # the wrapper kept aside, emptied of its D x d layer
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    start = {n: p.detach().clone() for n, p in lora.items()}
    opt = torch.optim.AdamW(lora.values(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(ids, targets=targets).backward()
        opt.step()
    assert int(factored_head(model).steps) == 2 and all(not torch.equal(p, start[n]) for n, p in lora.items())
    W = factored_head(model).weight()
    with torch.no_grad():
        patched = model(ids)
        export_dense_head(model)
        assert isinstance(model.lm_head, LoRALinear) and torch.equal(model.lm_head.linear.weight, W)
        assert torch.allclose(model(ids), patched, atol=1e-5)


def test_adapters_gpt_with_its_linear_lm_head_trains_and_exports():
    """litgpt.adapter's GPT keeps a linear lm_head: patched, its logits are the model's, it trains
    the head, and export gives its lm_head back."""
    from litgpt.adapter import GPT as AdapterGPT  # noqa: PLC0415
    from litgpt.adapter import Config as AdapterConfig

    torch.manual_seed(0)
    model = AdapterGPT(AdapterConfig(**TINY, adapter_prompt_length=4, adapter_start_layer=0))
    ids, targets = rows()
    with torch.no_grad():
        before = model(ids)
        factor_gpt_head(model, loss="zloss", lr=0.5)
        assert torch.allclose(model(ids), before, atol=1e-5)
    model(ids, targets=targets).backward()
    assert int(factored_head(model).steps) == 1
    assert isinstance(export_dense_head(model).lm_head, nn.Linear)


def test_bad_targets_get_one_line_and_no_step():
    ids, targets = rows()
    bad_id = targets.masked_fill(targets == 3, PADDED)
    model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5, sync_every=1)  # checks read at once
    before = state(model)
    for bad, says in ((targets[:, 1:], "targets must have the shape of idx"), (bad_id, "outside")):
        with pytest.raises(ValueError, match=says):
            model(ids, targets=bad).backward()
    after = state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # device flags (the default): a bad shape raises at once, a bad id at the next read, naming its step
    model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5)
    before = state(model)
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model(ids, targets=targets[:, 1:]).backward()
    model(ids, targets=bad_id).backward()
    with pytest.raises(ValueError, match="the batch of step 1 had target ids outside"):
        factored_head(model).sync()
    after = state(model)
    assert all(torch.equal(before[k], after[k]) for k in before if "skipped_nonfinite" not in k)


def test_a_training_forward_without_targets_is_refused_naming_them():
    """litgpt's ``chunked_cross_entropy(model(idx), targets)`` left in a loop: the logits carry no
    gradient (the head trains through its own loss), which failed at the backward ("element 0 of
    tensors does not require grad"). Refused in one line, nothing changed; logits without grad
    (no_grad, eval mode) as before."""
    ids, targets = rows()
    model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5)
    before = state(model)
    with pytest.raises(ValueError, match=r"needs targets.*model\(idx, targets=targets\)") as err:
        chunked_cross_entropy(model(ids), targets).backward()
    after = state(model)
    assert "\n" not in str(err.value) and all(torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        logits = model(ids)
    assert torch.equal(model.eval()(ids), logits) and logits.shape == (3, T, PADDED)


def test_the_compiled_model_steps_as_the_eager_one():
    """torch.compile(model), as litgpt's pretrain does: the same losses and head, step for step."""
    compiled, eager = factor_gpt_head(tiny_gpt(), lr=0.5), factor_gpt_head(tiny_gpt(), lr=0.5)
    run = torch.compile(compiled, backend="aot_eager")
    ids, targets = rows()
    for _ in range(3):
        a, b = run(ids, targets=targets), eager(ids, targets=targets)
        a.backward()
        b.backward()
        assert torch.allclose(a, b, rtol=1e-6)
    assert int(factored_head(compiled).steps) == 3
    assert torch.allclose(factored_head(compiled).weight(), factored_head(eager).weight(), atol=1e-6)


def test_a_fabric_loop_reads_the_host_at_most_once_in_ten_optimizer_steps():
    """litgpt's loop shape under Fabric (accumulation 2, the head attached to the optimizer):
    the head's device flags every 64 steps and the repairs then due are the only host reads of
    the package's, counted from the third optimizer step to the last of 66."""
    from host_reads import HostReads  # noqa: PLC0415

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    head = factored_head(model.module)
    head.attach(optimizer)
    ids, targets = rows(m=4, seed=3)
    reads = HostReads()
    for step in range(66):
        if step == 2:
            reads.__enter__()
        for k in range(2):
            with fabric.no_backward_sync(model, enabled=k == 0):
                fabric.backward(model(ids[2 * k:2 * k + 2], targets=targets[2 * k:2 * k + 2]) / 2)
        optimizer.step()
        optimizer.zero_grad()
    reads.__exit__(None, None, None)
    assert int(head.steps) == 66
    assert 1 <= reads.count <= 0.1 * 64, reads.sites


def test_a_patched_trained_gpt_pickles_and_deep_copies_with_its_forward_and_head():
    """``torch.save(model)`` / ``torch.load`` (and ``copy.deepcopy``) of a patched GPT that has
    trained: the copy's forward is still the patched one (it takes ``targets``), on its own head,
    and gives the same loss and step as the model."""
    model = factor_gpt_head(tiny_gpt(), loss="zloss", lr=0.5)
    ids, targets = rows()
    model(ids, targets=targets).backward()
    for twin in (make(model) for make in COPIES):  # each of the model as it is then
        assert twin.forward.args[0] is twin and factored_head(twin) is not factored_head(model)
        a, b = model(ids, targets=targets), twin(ids, targets=targets)
        assert torch.equal(a, b)
        a.backward()
        b.backward()
        assert torch.equal(factored_head(twin).weight(), factored_head(model).weight())
