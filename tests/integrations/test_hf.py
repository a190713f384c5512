import os
import warnings

import pytest
import torch
import torch.distributed as dist
from forked_ranks import fork_ranks
from torch import nn

from lst_lightning.integrations import export_dense_head, factor_lm_head, factored_head, untie_lm_head
from lst_lightning.integrations.hf import dense_outputs, shifted
from lst_lightning.integrations.processes import join_processes
from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

from round_trips import COPIES

from .conftest import VOCAB, batch, tiny


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_loss_is_the_heads_loss_on_the_shifted_hidden_states(family):
    model = factor_lm_head(tiny(family), loss="zloss")
    ids, mask, labels = batch()
    model.eval()  # a frozen head: the same state for both calls
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    hidden = model.base_model(input_ids=ids, attention_mask=mask)[0]
    H = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    model.lm_head.reduction = "mean_real"
    assert (y == -100).any() and torch.allclose(loss, model.lm_head(H, y), atol=1e-6)
    # the reference: the loss on the dense outputs o = W h, mean over the real tokens
    O = H.double() @ model.lm_head.weight().double().T
    real = y >= 0
    idx = y[real][:, None]
    q, s = (O[real] ** 2).sum(1), O[real].sum(1)
    ref = model.lm_head.loss_fn(q, s, O[real].gather(1, idx), torch.ones_like(idx, dtype=O.dtype),
                                num_classes=VOCAB).mean()
    assert torch.allclose(loss.double(), ref, rtol=1e-5)


def test_evaluating_the_sampled_loss_gives_the_exported_models_cross_entropy(family):
    """Without grad (``Trainer.evaluate()``), ``loss="sampled"`` (the default) is scored by the
    cross-entropy of softmax(o), its probability, over all D classes: the exported model's own
    loss (the mean over real tokens, or the sum over ``num_items_in_batch``), not the head's
    spherical terms alone; every label -100 gives 0; the state is unchanged."""
    model = factor_lm_head(tiny(family)).eval()
    ids, mask, labels = batch()
    before = state(model)
    with torch.no_grad():
        got = [model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss
               for kw in ({}, {"logits_to_keep": 1}, {"num_items_in_batch": 7})]
        padding = model(input_ids=ids, attention_mask=mask, labels=torch.full_like(labels, -100)).loss
    assert same_state(before, state(model)) and float(padding) == 0
    dense = export_dense_head(model)
    with torch.no_grad():
        want = [dense(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss
                for kw in ({}, {}, {"num_items_in_batch": 7})]
    assert all(torch.allclose(g, w, rtol=1e-5) for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("loss", ["zloss", "spherical_softmax", "taylor_softmax", "mse", "sampled"])
def test_a_training_step_matches_the_explicit_w_reference_with_the_pretrained_start(loss):
    """The patched model's loss, dL/dH and step equal the naive head's (explicit W, the
    pretrained lm_head weight with its bias column) on the same hidden states, in float64;
    with sampled classes inside the step (loss=sampled), on the same draws."""
    kw = {"negatives": {"num": 8, "seed": 3}} if loss == "sampled" else {}
    model = tiny("mistral").double()
    old = model.lm_head
    model.lm_head = nn.Linear(16, VOCAB, bias=True, dtype=torch.float64)
    model.lm_head.weight.data.copy_(old.weight)
    W = torch.cat([model.lm_head.weight, model.lm_head.bias[:, None]], 1).detach().clone()
    factor_lm_head(model, loss=loss, lr=0.3, **kw)
    naive = NaiveSphericalHead(VOCAB, 16, loss=loss, lr=0.3, bias=True, reduction="mean_real", dtype=torch.float64,
                               **kw)
    naive.reset_weight(W)
    ids, mask, labels = batch()
    model.train()
    hidden = model.base_model(input_ids=ids, attention_mask=mask)[0].detach()
    H, y = shifted(hidden, labels)
    H = H.clone().requires_grad_()
    ref = naive(H, y)
    ref.backward()
    seen = []
    model.base_model.register_forward_hook(lambda m, a, o: seen.append(o[0]) or o[0].retain_grad())
    out = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    out.backward()
    dH = seen[0].grad  # what the body receives: dL/dH at each position, none at the last
    assert (y == -100).any() and torch.allclose(out, ref, rtol=1e-10)
    assert torch.allclose(dH[:, :-1].reshape(-1, 16), H.grad, rtol=1e-8, atol=1e-12) and not dH[:, -1].any()
    assert torch.allclose(model.lm_head.weight(), naive.weight(), rtol=1e-8, atol=1e-10)
    assert not torch.allclose(naive.weight(), W)  # a step was taken


def test_pretrained_lm_head_is_the_initial_w_and_logits_match(family):
    model = tiny(family)
    ids, mask, _ = batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    factor_lm_head(model)
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=mask).logits
        last = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits
    assert after.shape == before.shape and torch.allclose(after, before, atol=1e-5)
    assert torch.allclose(last, before[:, -1:], atol=1e-5)
    H = model.base_model(input_ids=ids, attention_mask=mask)[0].reshape(-1, 16).detach()
    assert torch.allclose(model.lm_head.scores(H), before.reshape(-1, VOCAB), atol=1e-5)  # zloss: score = o


def test_lm_head_with_a_bias_becomes_the_bias_column():
    model = tiny("llama")
    old = model.lm_head
    model.lm_head = nn.Linear(old.in_features, old.out_features, bias=True)
    nn.init.normal_(model.lm_head.bias)
    ids, mask, _ = batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        factor_lm_head(model)
        after = model(input_ids=ids, attention_mask=mask).logits
    assert model.lm_head.bias and torch.allclose(after, before, atol=1e-5)


def test_dense_outputs_in_chunks_equal_w_h():
    head = FactoredSphericalHead(VOCAB, 16, bias=True)
    H = torch.randn(2, 5, 16)
    ref = torch.cat([H, torch.ones(2, 5, 1)], -1) @ head.weight().T
    assert torch.allclose(dense_outputs(head, H, chunk_size=7), ref, atol=1e-5)


def test_no_logits_in_training_and_training_lowers_the_loss(family):
    model = factor_lm_head(tiny(family), loss="zloss", lr=0.5)
    model.train()
    ids, mask, labels = batch()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert out.logits is None
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.9 * losses[0] and int(model.lm_head.steps) == 8


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_trains_the_model_bit_for_bit_as_without_it(use_reentrant):
    """``gradient_checkpointing_enable()`` (the Trainer's ``gradient_checkpointing=True``) runs the
    body's layers again in the backward: the head still steps once per backward, on the same dL/dH."""
    ids, mask, labels = batch()
    models = []
    for checkpointing in (False, True):
        model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, dtype=torch.float64).double()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
        models.append(model)
    plain, checkpointed = models
    assert int(factored_head(checkpointed).steps) == 3
    assert same_state(state(plain), state(checkpointed))


def test_num_items_in_batch_two_halves_equal_the_full_batch():
    ids, mask, labels = batch(m=3)
    n = int((labels[:, 1:] != -100).sum())
    models = []
    for split in (False, True):
        model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, dtype=torch.float64).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        factored_head(model).attach(opt)
        parts = [(0, 3)] if not split else [(0, 1), (1, 3)]
        total = 0.0
        for a, b in parts:
            loss = model(input_ids=ids[a:b], attention_mask=mask[a:b], labels=labels[a:b], num_items_in_batch=n).loss
            loss.backward()
            total += float(loss.detach())
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        models.append((total, grads, model))
    (l0, g0, m0), (l1, g1, m1) = models
    assert l0 == pytest.approx(l1, rel=1e-10)
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(g0, g1))
    W0, W1 = m0.lm_head.weight(), m1.lm_head.weight()
    assert not torch.allclose(W0, tiny("llama").lm_head.weight.double()) and torch.allclose(W0, W1, atol=1e-10)


def test_tied_embeddings_are_refused_and_the_model_is_unchanged():
    model = tiny("llama", tie_word_embeddings=True)
    before = state(model)
    with pytest.raises(ValueError, match="ties lm_head to the input embedding"):
        factor_lm_head(model)
    assert isinstance(model.lm_head, nn.Linear) and "forward" not in vars(model) and same_state(before, state(model))


def test_a_model_built_on_the_meta_device_is_patched_and_takes_a_patched_models_state_by_assign():
    """A model too large to build twice: built on the meta device, patched (the head waits there for
    its state), then given a trained patched model's state by ``load_state_dict(assign=True)``. The
    head takes it on the state's device and steps as the trained one. (A meta model's tensors all
    have data_ptr 0: it was refused as tied; a tied one still is.)"""
    trained = factor_lm_head(tiny("llama"))
    ids = torch.randint(0, 20, (2, 8), generator=torch.Generator().manual_seed(0))
    trained(input_ids=ids, labels=ids).loss.backward()
    with torch.device("meta"):
        model, tied = tiny("llama"), tiny("llama", tie_word_embeddings=True)
    with pytest.raises(ValueError, match="ties lm_head to the input embedding"):
        factor_lm_head(tied)
    factor_lm_head(model)
    assert model.lm_head.device.type == "meta"
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in trained.state_dict().items()}
    model.load_state_dict(state, assign=True)  # (assign: the head holds these very tensors)
    head, ref = model.lm_head, trained.lm_head
    assert {b.device.type for b in head.buffers()} == {"cpu"} and head.dtype == ref.dtype
    H = torch.randn(5, head.hidden_dim, generator=torch.Generator().manual_seed(1))
    idx = torch.randint(0, 20, (5,), generator=torch.Generator().manual_seed(2))
    for h in (head, ref):
        h(H.clone().requires_grad_(), idx).backward()
    a, b = head.state_dict(), ref.state_dict()
    assert int(head.steps) == int(ref.steps) == 2 and all(torch.equal(a[k], b[k]) for k in a if torch.is_tensor(a[k]))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mistral"])
def test_an_untied_copy_of_a_tied_model_is_accepted_and_keeps_its_logits(family):
    model = tiny(family, tie_word_embeddings=True)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    ids, mask, _ = batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        factor_lm_head(untie_lm_head(model))
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(after, before, atol=1e-5)
    model.train()
    embedding = model.get_input_embeddings().weight.detach().clone()
    model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # the head's step leaves it alone
    assert not torch.allclose(model.lm_head.weight(), embedding)


def test_a_model_without_an_lm_head_linear_is_refused():
    model = tiny("llama")
    model.lm_head = nn.Sequential(model.lm_head)
    before = state(model)
    with pytest.raises(ValueError, match="no `lm_head` nn.Linear"):
        factor_lm_head(model)
    assert same_state(before, state(model))


def test_a_model_without_a_body_of_its_own_is_refused():
    body = tiny("llama").model
    body.lm_head = nn.Linear(16, VOCAB, bias=False)  # a base model with a linear layer named lm_head
    before = state(body)
    with pytest.raises(ValueError, match="no body apart from itself"):
        factor_lm_head(body)
    assert same_state(before, state(body)) and "forward" not in vars(body)


@pytest.mark.parametrize("train", [True, False])
def test_sequences_of_one_token_are_refused_naming_the_causal_shift(train):
    """A batch of one-token sequences leaves the shift no position to predict: one line that says
    so (it said "H has no rows: the minibatch is empty"), training or evaluating, nothing changed."""
    ids, mask, labels = batch()
    model = factor_lm_head(tiny("llama"))
    model.train(train)
    before = state(model)
    with pytest.raises(ValueError, match="sequences have 1 token") as err, torch.set_grad_enabled(train):
        model(input_ids=ids[:, :1], attention_mask=mask[:, :1], labels=labels[:, :1])
    assert "\n" not in str(err.value) and same_state(before, state(model))


def test_a_training_forward_without_labels_is_refused_and_logits_come_without_grad_or_in_eval():
    """The head's logits carry no gradient: a loss computed from them (the Trainer's
    compute_loss_func) failed at its backward ("element 0 of tensors does not require grad").
    A training forward without labels is refused in one line before the body runs; logits under
    no_grad or in eval mode are the outputs as before."""
    ids, mask, _ = batch()
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)
    before = state(model)
    with pytest.raises(ValueError, match="needs labels.*compute_loss_func") as err:
        model(input_ids=ids, attention_mask=mask)
    assert "\n" not in str(err.value) and same_state(before, state(model))
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    model.eval()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, logits)
    assert logits.shape == (3, 10, VOCAB) and same_state(before, state(model))


@pytest.mark.parametrize("train", [True, False])
def test_labels_of_another_shape_than_the_input_are_refused_before_the_body_runs(train):
    """Labels shifted already (b, T - 1) said "target_idx must have shape (27,) ..."; labels
    (3, 3) for ids (2, 4) have as many elements after the shift and trained on misaligned
    pairs without a word. Both are refused in one line naming the input's shape, nothing
    changed, ids or inputs_embeds alike."""
    ids, mask, labels = batch()
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5, sync_every=1)
    model.train(train)
    embeds = model.get_input_embeddings()(ids[:2, :4]).detach()
    before = state(model)
    for given, bad in ((dict(input_ids=ids, attention_mask=mask), labels[:, 1:]),
                       (dict(input_ids=ids[:2, :4]), labels[:, :3]), (dict(inputs_embeds=embeds), labels[:, :3])):
        shape = tuple(given.get("input_ids", embeds[..., 0]).shape)
        with pytest.raises(ValueError, match=rf"labels must have the shape of the input \({shape[0]}, {shape[1]}\)") as err:
            model(**given, labels=bad).loss.backward()
        assert "\n" not in str(err.value) and same_state(before, state(model))
    assert int(model.lm_head.steps) == 0


def test_a_label_outside_the_vocabulary_is_refused_and_nothing_changes():
    ids, mask, labels = batch()
    labels[0, 4] = VOCAB
    model = factor_lm_head(tiny("qwen2"), sync_every=1)  # checks read at once: the forward raises
    model.train()
    before = state(model)
    with pytest.raises(ValueError, match="outside"):
        model(input_ids=ids, attention_mask=mask, labels=labels)
    assert same_state(before, state(model))
    # device flags (the default): the step is void, and the next read of the flags says which
    model = factor_lm_head(tiny("qwen2"))
    model.train()
    before = state(model)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with pytest.raises(ValueError, match=r"the batch of step 1 had target ids outside \[0, "):
        model.lm_head.sync()
    after = state(model)
    assert int(after["lm_head.skipped_nonfinite"]) == 1 and int(after["lm_head.steps"]) == 0
    # (uinv_fresh: the CPU's solve route marks U^-1 for a refresh from U, taken or not: the host
    # cannot know which without a read; the refresh is exact; the sampled classes' generator has
    # drawn the void step's classes)
    assert all(torch.equal(before[k], after[k]) for k in before if k.startswith("lm_head.") and
               not k.endswith(("steps", "skipped_nonfinite", "uinv_fresh", "negatives_rng")))


def test_a_model_whose_parameters_fsdp1_flattened_is_refused_in_training_and_nothing_changes():
    """FSDP1 marks every parameter it flattens (``_fsdp_flattened``): your own FSDP1 loop is
    refused at the first training forward, in one line; evaluation forwards are left alone."""
    model = factor_lm_head(tiny("llama"))
    next(model.base_model.parameters())._fsdp_flattened = True  # what FullyShardedDataParallel sets
    ids, mask, labels = batch()
    before = state(model)
    model.train()
    with pytest.raises(ValueError, match=r"cannot train under FSDP1 .*FSDP2 instead") as e:
        model(input_ids=ids, attention_mask=mask, labels=labels)
    assert "\n" not in str(e.value) and same_state(before, state(model))
    model.eval()
    assert model(input_ids=ids, attention_mask=mask, labels=labels).loss is not None


def test_the_fsdp1_scan_runs_until_a_training_forward_passes(monkeypatch):
    """The parameters are scanned at training forwards until one passes, not at every step."""
    from lst_lightning.integrations import processes

    model = factor_lm_head(tiny("llama"))
    ids, mask, labels = batch()
    model.train()
    scans = []
    params = type(model).parameters
    monkeypatch.setattr(type(model), "parameters", lambda self, *a, **k: scans.append(1) or params(self, *a, **k))
    for _ in range(3):
        processes.check_not_fsdp1(model)
    assert len(scans) == 1


def test_patching_twice_and_head_arguments_it_owns_are_refused():
    model = factor_lm_head(tiny("gpt2"))
    with pytest.raises(ValueError, match="already"):
        factor_lm_head(model)
    with pytest.raises(ValueError, match="sets reduction itself"):
        factor_lm_head(tiny("gpt2"), reduction="sum")
    with pytest.raises(ValueError, match="no factored head"):
        factored_head(tiny("gpt2"))


def test_resizing_the_embeddings_of_a_patched_model_is_refused_and_changes_nothing():
    """transformers' resize_token_embeddings resized the input embedding and then failed on the
    head ("'function' object has no attribute 'size'"): refused in one line, nothing changed;
    after export it resizes, and the model takes the head again."""
    model = factor_lm_head(tiny("llama"))
    before = state(model)
    with pytest.raises(ValueError, match="export_dense_head.model. first, resize, then factor_lm_head") as e:
        model.resize_token_embeddings(VOCAB + 8)
    assert "\n" not in str(e.value) and same_state(before, state(model)) and model.config.vocab_size == VOCAB
    export_dense_head(model).resize_token_embeddings(VOCAB + 8)
    factor_lm_head(model)
    assert model.lm_head.num_classes == model.get_input_embeddings().num_embeddings == VOCAB + 8


def test_shifted_pairs_each_position_with_the_next_label():
    hidden = torch.arange(2 * 4, dtype=torch.float32).reshape(2, 4, 1)
    labels = torch.tensor([[5, 6, 7, 8], [1, 2, -100, -100]])
    H, y = shifted(hidden, labels)
    assert H[:, 0].tolist() == [0, 1, 2, 4, 5, 6] and y.tolist() == [6, 7, 8, 2, -100, -100]


def test_a_patched_model_saves_tensors_only_and_loads_them_back_bit_for_bit(tmp_path):
    model = factor_lm_head(tiny("llama"), lr=0.5)
    model.train()
    ids, mask, labels = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # a step solving with U leaves U^-1 stale: the flag must travel
        opt.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
    saved = model.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in saved.values()) and "lm_head._extra_state" not in saved
    model.save_pretrained(tmp_path)  # safetensors: tensors only
    for fresh in (True, False):
        other = factor_lm_head(tiny("llama"), lr=0.5)
        other.lm_head._uinv_fresh = fresh
        other.load_state_dict(saved)  # strict
        assert other.lm_head.uinv_fresh == model.lm_head.uinv_fresh and other.lm_head.lr == 0.5
        assert same_state(state(model), state(other))
    steps = []
    for m in (model, other):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        steps.append(state(m))
    assert same_state(*steps)  # the next step too, bit for bit


def test_a_saved_shard_of_v_carries_its_rows_and_loads_only_into_them():
    """A sharded head saved without its V gathered keeps its rows as a tensor (the extra state is
    left out): loaded into a head that holds other rows, one ValueError and nothing changed."""
    model = factor_lm_head(tiny("llama"))
    state = model.state_dict()
    shard = {**state, "lm_head.V": state["lm_head.V"][:20].clone() + 1, "lm_head.v_rows": torch.tensor([0, 20])}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"rows 0:20 of V's {VOCAB}.*gather_head_for_checkpoint") as e:
        model.load_state_dict(shard)
    assert "\n" not in str(e.value) and same_state(before, model.state_dict())


@pytest.mark.slow  # a compile a family (the default suite compiles a patched model: test_litgpt.py's)
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2", "mistral"])
def test_the_compiled_model_steps_as_the_eager_one(family):
    """torch.compile(model), as the Trainer's ``torch_compile`` and accelerate's dynamo plugin do: the
    patched forward is traced with the body, the head's step runs outside the graph, and the losses
    and the head are the eager model's, step for step."""
    compiled, eager = factor_lm_head(tiny(family), lr=0.5), factor_lm_head(tiny(family), lr=0.5)
    run = torch.compile(compiled, backend="aot_eager")
    ids, mask, labels = batch()
    for _ in range(3):
        a = run(input_ids=ids, attention_mask=mask, labels=labels).loss
        b = eager(input_ids=ids, attention_mask=mask, labels=labels).loss
        a.backward()
        b.backward()
        assert torch.allclose(a, b, rtol=1e-6)
    assert int(compiled.lm_head.steps) == 3
    assert torch.allclose(compiled.lm_head.weight(), eager.lm_head.weight(), atol=1e-6)


def test_saving_a_shard_of_v_warns_that_from_pretrained_would_get_a_random_lm_head(tmp_path):
    """``save_pretrained`` on one rank of a sharded head whose V was not gathered writes that rank's
    rows and no dense lm_head (there is no W to form): one warning naming the fix, the file written."""
    model = factor_lm_head(tiny("llama"))
    state = model.state_dict()
    shard = {**state, "lm_head.V": state["lm_head.V"][:20].clone(), "lm_head.v_rows": torch.tensor([0, 20])}
    with pytest.warns(UserWarning, match=r"^save_pretrained: this file holds this rank's rows .*LlamaForCausalLM"
                                         r"\.from_pretrained would make a random lm_head: call "
                                         r"gather_head_for_checkpoint\(model\) on every rank before the save$"):
        model.save_pretrained(tmp_path, state_dict=shard)
    assert (tmp_path / "model.safetensors").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.save_pretrained(tmp_path / "whole")  # the whole V: no warning


def test_under_bf16_autocast_the_loss_is_the_heads_loss_in_its_own_precision():
    model = factor_lm_head(tiny("llama"), loss="zloss", lr=0.5)  # a loss without draws: two calls alike
    ids, mask, labels = batch()
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        hidden = model.base_model(input_ids=ids, attention_mask=mask)[0]
    assert loss.dtype == torch.float32  # the head computes in its own float32
    H, y = shifted(hidden, labels)
    assert torch.equal(loss, model.lm_head(H.float(), y))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0] and int(model.lm_head.skipped_nonfinite) == 0


def test_logits_under_bf16_autocast_are_the_outputs_in_the_heads_precision():
    model = factor_lm_head(tiny("gpt2")).eval()
    ids, mask, _ = batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=mask).logits
        hidden = model.base_model(input_ids=ids, attention_mask=mask)[0]
    ref = hidden.float().reshape(-1, 16) @ model.lm_head.weight().T
    assert torch.allclose(logits.float().reshape(-1, VOCAB), ref, rtol=1e-2, atol=1e-2)


def test_a_patched_trained_model_pickles_and_deep_copies_with_its_forward_and_head(family):
    """``torch.save(model)`` / ``torch.load`` (and ``copy.deepcopy``) of a patched model that has
    trained: the copy's forward is still the patched one, on its own head, and gives the same loss
    and step as the model."""
    model = factor_lm_head(tiny(family), loss="zloss", lr=0.5)
    ids, mask, labels = batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    for twin in (make(model) for make in COPIES):  # each of the model as it is then
        assert twin.forward.model is twin and factored_head(twin) is not factored_head(model)
        a, b = (m(input_ids=ids, attention_mask=mask, labels=labels) for m in (model, twin))
        assert a.logits is None and b.logits is None and torch.equal(a.loss, b.loss)
        a.loss.backward()
        b.loss.backward()
        assert torch.equal(factored_head(twin).weight(), factored_head(model).weight())



def _sharded_rank(rank, port, out):
    """A rank of two with the head sharded, scoring its own rows (a number of its own): the
    patched model's logits and evaluation loss, then the exported model's."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = factor_lm_head(tiny("llama"), parallel="sharded").eval()
    join_processes(model.lm_head)
    ids, mask, labels = batch(m=1 + rank, seed=3 + rank)  # each rank its own rows, 1 and 2 sequences
    got = {"held": model.lm_head.V.shape[0]}
    for name in ("patched", "exported"):
        with torch.no_grad():
            got[name] = (model(input_ids=ids, attention_mask=mask).logits,
                         model(input_ids=ids, attention_mask=mask, labels=labels).loss)
        if name == "patched":
            export_dense_head(model)  # every rank: the whole W
    torch.save(got, out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_a_sharded_heads_logits_and_evaluation_loss_are_each_ranks_own_rows(tmp_path):
    """On two processes, each scoring rows of its own (2 and 1 sequences), a sharded head's
    logits and evaluation loss are those of the exported model on that rank's rows: every
    rank's rows are scored on every rank's classes (not rank r's rows on rank r's classes)."""
    for r, got in enumerate(fork_ranks(_sharded_rank, tmp_path)):
        (logits, loss), (want_logits, want_loss) = got["patched"], got["exported"]
        assert got["held"] == VOCAB // 2 and logits.shape == want_logits.shape == (1 + r, 10, VOCAB)
        assert torch.allclose(logits, want_logits, atol=1e-5) and torch.allclose(loss, want_loss, rtol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_a_model_whose_logits_are_not_lm_heads_outputs_is_refused_and_unchanged(family):
    """Gemma 2's cap tanh(o / cap), Cohere's o * logit_scale, Granite's o / logits_scaling: the
    factored head trains and returns o itself, so such a model is refused, unchanged, with the
    setting named; with it set to its plain value the model is patched."""
    import transformers
    small = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    key, value, plain, cls, config = {
        "gemma2": ("final_logit_softcapping", 30.0, None, transformers.Gemma2ForCausalLM,
                   transformers.Gemma2Config(head_dim=8, **small)),
        "cohere": ("logit_scale", 0.0625, 1.0, transformers.CohereForCausalLM,
                   transformers.CohereConfig(**small)),
        "granite": ("logits_scaling", 8.0, 1.0, transformers.GraniteForCausalLM,
                    transformers.GraniteConfig(**small))}[family]
    setattr(config, key, value)
    model = cls(config)
    before = state(model)
    with pytest.raises(ValueError, match=rf"logits are not lm_head's outputs \((model|model\.config)\.{key}={value}\)"):
        factor_lm_head(model)
    assert isinstance(model.lm_head, nn.Linear) and "forward" not in vars(model) and same_state(before, state(model))
    setattr(model.config, key, plain)
    if hasattr(model, key):
        setattr(model, key, plain)
    factor_lm_head(model)
    ids, mask, labels = batch()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, attention_mask=mask, labels=labels).loss)


def test_a_model_with_anything_between_its_body_and_lm_head_is_refused_and_unchanged():
    """A transform no setting names (here a factor in the model's own forward, as Falcon-H1's
    lm_head_multiplier or a norm in the CausalLM class would be): the model's logits are not
    lm_head of its body's output, which is what the factored head takes; refused, unchanged."""
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0.5
            return out
    model = Scaled(tiny("llama").config).float()
    model.train()
    before = state(model)
    with pytest.raises(ValueError, match=r"logits are not lm_head applied to its body's output"):
        factor_lm_head(model)
    assert model.training and isinstance(model.lm_head, nn.Linear) and same_state(before, state(model))


def test_a_model_that_keeps_its_last_positions_logits_only_is_accepted():
    """The check compares the positions the model returns logits for (a forward whose default
    keeps the last one only is not a transform)."""
    from transformers import LlamaForCausalLM

    class LastOnly(LlamaForCausalLM):
        def forward(self, *args, logits_to_keep=1, **kwargs):
            return super().forward(*args, logits_to_keep=logits_to_keep, **kwargs)
    model = factor_lm_head(LastOnly(tiny("llama").config).float())
    assert isinstance(model.lm_head, FactoredSphericalHead)
