"""What both spherical heads share (base.py): input checks before any change, the
training-step semantics of forward and backward, skipped non-finite steps."""
import copy
import warnings

import pytest
import torch

from lst_lightning.spherical import FactoredSphericalHead, NaiveSphericalHead

from round_trips import COPIES, spawned

from head_pairs import D, assert_load_refused, assert_untouched, batch, d, deferred, make_pair, rel, state, state_of, step


def test_eval_mode_and_no_grad_do_not_update():
    f, _ = make_pair("zloss")
    before = copy.deepcopy(f.state_dict())
    H, idx = batch(4, 8, 60, 1)
    f.eval()
    f(H.requires_grad_(), idx)
    f.train()
    with torch.no_grad():
        f(H, idx)
    for k, v in f.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, before[k]), k



def checked_at_once(cls, **kw):
    """A head that reads each check as it is made: the naive head, the factored head with
    ``sync_every=1`` (device flags, its default, report at the next read: test_device_flags.py)."""
    return cls(**kw, **({"sync_every": 1} if cls is FactoredSphericalHead else {}))


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_bad_input_is_refused_and_state_untouched(cls):
    head = checked_at_once(cls, num_classes=20, hidden_dim=4, loss="zloss", bias=False)
    before, version = state_of(head), head._version
    H = torch.randn(3, 4, requires_grad=True)
    ok = torch.tensor([1, 2, 3])
    cases = [
        ((H, torch.tensor([1, 20, 3])), ValueError, "outside"),
        ((H, torch.tensor([1, -2, 3])), ValueError, "outside"),
        ((torch.randn(3, 5), ok), ValueError, "hidden_dim"),
        ((torch.randn(3), ok), ValueError, "2-D"),
        ((torch.randn(0, 4), torch.zeros(0, dtype=torch.long)), ValueError, "empty"),
        ((H, ok.float()), TypeError, "int64"),
        ((H, torch.tensor([1, 2]),), ValueError, "shape"),
        ((H.int(), ok), TypeError, "floating"),
        ((torch.randn(3, 4, device="meta"), ok), ValueError, "meta"),
        ((H, ok, torch.ones(3, 2)), ValueError, "target_val"),
        ((H, ok, torch.ones(3, dtype=torch.long)), TypeError, "target_val"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            head(*args)
    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="lr"):
            head.lr = bad
    with pytest.raises(ValueError, match="weight_decay"):
        head.weight_decay = -0.1
    head.lr, head.weight_decay = 10.0, 0.5
    with pytest.raises(ValueError, match="flip"):
        head(H, ok)
    with pytest.raises(ValueError, match="shape"):
        head.reset_weight(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="non-finite"):
        head.reset_weight(torch.full((20, 4), float("nan")))
    assert_untouched(head, before)  # its counters too (in the state dict)
    assert head._version == version  # no step began: a backward of an earlier forward is not stale
    if cls is FactoredSphericalHead:
        assert head.step_checks.calls == 0



def test_scores_takes_a_range_of_classes_never_a_python_slice():
    """``scores(H, start, end)`` refuses what a Python slice would wrap or clip (an empty range, a
    negative start, an end past D), as the baselines do; a range inside [0, D) is the outputs' own."""
    f, n = make_pair("zloss")
    H = torch.randn(3, d, dtype=torch.float64)
    for head in (f, n):
        for start, end in ((5, 2), (4, 4), (-3, None), (0, D + 9)):
            with pytest.raises(ValueError, match=rf"^need 0 <= start < end <= {D}, got start={start}, end="):
                head.scores(H, start, end)
        assert head.scores(H, D - 3).shape == (3, 3)
        torch.testing.assert_close(head.scores(H, 5, 9), head.scores(H)[:, 5:9], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_non_finite_steps_are_skipped_counted_and_warned_sparingly(cls):
    head = checked_at_once(cls, num_classes=20, hidden_dim=4, loss="spherical_softmax", bias=False)
    before = state_of(head)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(10):
            H = torch.randn(3, 4)
            H[1, 2] = float("nan") if i % 2 else float("inf")
            H.requires_grad_()
            head(H, torch.tensor([1, 2, 3])).backward()
            assert torch.equal(H.grad, torch.zeros_like(H))
        val = torch.tensor([1.0, float("inf"), 1.0])
        head(torch.randn(3, 4, requires_grad=True), torch.tensor([1, 2, 3]), val).backward()
    assert int(head.skipped_nonfinite) == 11
    assert sum("non-finite" in str(w.message) for w in caught) == 4  # at 1, 2, 4, 8
    before["skipped_nonfinite"] = head.skipped_nonfinite
    assert_untouched(head, before)


@pytest.mark.parametrize("cls,scale", [(FactoredSphericalHead, 1e12), (FactoredSphericalHead, 1e20),
                                       (NaiveSphericalHead, 1e20)])
def test_an_overflowing_step_is_skipped_not_raised(cls, scale):
    """Finite but huge hidden rows (a diverging body): the step's products overflow (the
    factored head's d x d bookkeeping, fourth powers of H, already at 1e12; the naive head's
    outputs squared at 1e20). The step is skipped and counted like a non-finite one, the
    state untouched."""
    torch.manual_seed(0)
    head = cls(num_classes=50, hidden_dim=4, loss="mse", lr=1.0, bias=True)
    before = state_of(head)
    H = (torch.randn(8, 4) * scale).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        head(H, torch.randint(0, 50, (8,))).backward()
    assert int(head.skipped_nonfinite) == 1 and int(head.steps) == 0
    before["skipped_nonfinite"] = head.skipped_nonfinite
    assert_untouched(head, before)


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_a_data_parallel_copy_refuses_to_train_and_still_scores(cls):
    """nn.DataParallel on several GPUs runs a copy of the module on each (torch's
    ``_replicate_for_data_parallel``, which it calls for every GPU: the copies share the buffers
    on the first GPU, hold copies on the others). The head steps itself, so each copy's step
    would be lost or would take one GPU's rows only: a training forward of a copy is refused in
    one line, before anything changes; evaluation through a copy still answers."""
    head = cls(num_classes=20, hidden_dim=4, loss="zloss", bias=False)
    copy_ = head._replicate_for_data_parallel()
    before, version = state_of(head), head._version
    H, idx = torch.randn(3, 4, requires_grad=True), torch.tensor([1, 2, 3])
    with pytest.raises(RuntimeError, match=r"nn.DataParallel .* one process per GPU") as e:
        copy_(H, idx)
    assert "\n" not in str(e.value) and head._version == version
    assert_untouched(head, before)
    copy_.eval()
    assert torch.equal(copy_(H, idx), head.eval()(H, idx))
    head.train()
    head(H, idx).backward()  # the head itself trains as ever
    assert int(head.steps) == 1


def _trained(cls, dtype=torch.float64, **kw):
    """A head of ``cls`` (lst-train's default loss: its draws and P) after 5 steps, made the same way each call."""
    head = cls(num_classes=40, hidden_dim=4, dtype=dtype, generator=torch.Generator().manual_seed(3), **kw)
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        H = torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True)
        head(H, torch.randint(-1, 40, (3, 2), generator=g)).backward()
    return head


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
@pytest.mark.parametrize("state_dtype", [torch.float64, torch.float32])
def test_a_head_built_on_the_meta_device_takes_its_state_by_assign(cls, state_dtype):
    """``load_state_dict(assign=True)`` on a head built on the meta device (a model too large to build
    twice), directly and as part of a model: the head takes the state's device and dtype (torch's
    ``assign``: a float32 head given a float64 state is float64) and steps bit for bit as a head that
    copied the state in. It said it was on the meta device, and asked for the state dict it had."""
    state = _trained(cls, state_dtype).state_dict()
    copied = cls(num_classes=40, hidden_dim=4, dtype=state_dtype)
    copied.load_state_dict(state)
    model = torch.nn.Sequential(cls(num_classes=40, hidden_dim=4, device="meta"))  # float32
    model.load_state_dict({f"0.{k}": v for k, v in state.items()}, assign=True)
    assigned = model[0]
    assert assigned.device.type == "cpu" and assigned.dtype == state_dtype
    assert all(b.device.type == "cpu" for b in assigned.buffers())
    assert assigned.plan.device == "cpu"  # the step's plan (its kernel ops) made for the state's device
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randint(-1, 40, (3, 2), generator=g))
               for _ in range(20)]
    for head in (copied, assigned):
        for H, idx in batches:
            head(H.requires_grad_(), idx).backward()
    assert int(assigned.steps) == 25
    assert all(torch.equal(v, state_of(copied)[k]) for k, v in state_of(assigned).items())


def test_a_half_precision_state_given_by_assign_is_refused_and_nothing_changes():
    state = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
             for k, v in _trained(FactoredSphericalHead).state_dict().items()}
    head = FactoredSphericalHead(num_classes=40, hidden_dim=4, dtype=torch.float64)
    before = state_of(head)
    with pytest.raises(ValueError, match="bfloat16, which assign=True would make this head's") as e:
        head.load_state_dict(state, assign=True)
    assert "\n" not in str(e.value) and head.dtype == torch.float64
    assert_untouched(head, before)


def test_two_forwards_before_backward_is_an_error_before_any_change():
    f, _ = make_pair("zloss")
    H, idx = batch(3, 8, 60, 1)
    W0 = f.weight()
    L1 = f(H.clone().requires_grad_(), idx)
    with pytest.raises(RuntimeError, match="second training forward"):
        f(H.clone().requires_grad_(), idx)
    assert torch.equal(f.weight(), W0) and int(f.steps) == 0
    L1.backward()  # the first forward still steps
    assert int(f.steps) == 1
    del L1
    f(H.clone().requires_grad_(), idx)  # a dropped loss, never backpropagated, does not block
    f(H.clone().requires_grad_(), idx)


def test_state_changed_between_forward_and_backward_is_an_error():
    f, _ = make_pair("zloss")
    H, idx = batch(3, 8, 60, 1)
    L = f(H.clone().requires_grad_(), idx)
    f.reset_weight(f.weight())
    with pytest.raises(RuntimeError, match="state changed"):
        L.backward()



def test_hidden_without_grad_still_updates_the_head():
    f, n = make_pair("taylor_softmax", lr=0.05)
    H, idx = batch(4, 8, 60, 2)
    f(H, idx).backward()
    n(H, idx).backward()
    assert rel(f.weight(), n.weight()) < 1e-12 and int(f.steps) == 1


@pytest.mark.parametrize("how", ["autograd", "train_step"])
def test_decay_that_would_flip_w_is_refused_untouched(how):
    head = deferred(sync_every=1, weight_decay=0.5)
    head.lr = 2.0  # lr * weight_decay = 1
    H, idx = batch(4, d, D, 1)
    before = state(head)
    with pytest.raises(ValueError, match="the decay would flip W"):
        step(head, H, idx) if how == "autograd" else head.train_step(H, idx)
    assert state(head) == before and int(head.steps) == 0


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_default_init_std_is_the_losss_rule_at_every_D(cls):
    """The initial W's std: min(1/sqrt(d + 1), 1/sqrt(D)) for the Z-loss and mse,
    1/sqrt(d + 1) for the spherical and Taylor softmax; an explicit init_std wins
    (docs/learning_at_scale.md: the old 1/sqrt(d + 1) for every loss kept the Z-loss at the
    class frequencies at large D)."""
    torch.manual_seed(0)
    width = 16  # 15 hidden units + the bias column
    cases = [(20_000, "zloss", None, 20_000 ** -0.5), (8, "zloss", None, width ** -0.5),
             (20_000, "mse", None, 20_000 ** -0.5), (20_000, "spherical_softmax", None, width ** -0.5),
             (20_000, "taylor_softmax", None, width ** -0.5), (20_000, "zloss", 0.5, 0.5)]
    for classes, loss, given, want in cases:
        head = cls(classes, width - 1, loss=loss, bias=True, init_std=given)
        got = head.weight().std().item() if classes > 100 else head._init_std
        assert abs(got / want - 1) < 0.03, (classes, loss, given, got, want)


@pytest.mark.parametrize("bad", [0.0, -0.1, float("nan"), float("inf"), "0.1", True])
def test_bad_init_std_is_refused(bad):
    with pytest.raises(ValueError, match="init_std must be a finite number > 0"):
        FactoredSphericalHead(100, 8, init_std=bad)


@pytest.mark.parametrize("bad,says", [(torch.bfloat16, "got torch.bfloat16"), ("float32", "got 'float32'")])
def test_a_dtype_other_than_float32_or_float64_is_refused_naming_what_was_given(bad, says):
    """A string, as transformers' ``from_pretrained(dtype="float32")`` takes, is not a torch.dtype:
    the line says which was given (it read "float32 or float64, got float32")."""
    with pytest.raises(TypeError, match=f"torch.float32 or torch.float64, {says}$"):
        FactoredSphericalHead(100, 8, dtype=bad)


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_a_state_holding_per_class_step_sizes_is_refused_in_one_line_untouched(cls):
    """A state with ``row_acc`` (per-class step sizes, which the heads do not take) is refused
    before any buffer is written; without that entry it loads."""
    head = cls(D, d, generator=torch.Generator().manual_seed(0))
    saved = {**head.state_dict(), "row_acc": torch.ones(D, 2)}
    step(head, *batch(6, d, D, 3, dtype=torch.float32))
    before, version = state_of(head), head._version
    with pytest.raises(ValueError, match="per-class step sizes .*row_acc") as err:
        head.load_state_dict(saved)
    assert "\n" not in str(err.value)
    assert_untouched(head, before)
    assert head._version == version  # nothing of the head's own changed either
    del saved["row_acc"]
    head.load_state_dict(saved)


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
@pytest.mark.parametrize("bad", ["shape", "nan", "inf"])
def test_a_state_torch_would_load_in_part_is_refused_in_one_line_untouched(cls, bad):
    """A state tensor of another shape (torch copies every other one, then raises) or holding
    a non-finite value is refused before any buffer or the head's own version changes."""
    head = cls(D, d, generator=torch.Generator().manual_seed(0))
    other = cls(D, d, generator=torch.Generator().manual_seed(1))
    step(other, *batch(6, d, D, 3, dtype=torch.float32))
    saved = other.state_dict()
    name = "W" if cls is NaiveSphericalHead else "V"
    if bad == "shape":
        name = "W" if cls is NaiveSphericalHead else "U"
        saved[name] = torch.zeros(3, 3)
    else:
        saved[name] = saved[name].clone()
        saved[name][D // 2, 1] = float(bad)
    step(head, *batch(6, d, D, 3, dtype=torch.float32))
    before, version = state_of(head), head._version
    with pytest.raises(ValueError, match=f"the state's {name} (has shape|holds non-finite)") as err:
        head.load_state_dict(saved)
    assert "\n" not in str(err.value)
    assert_untouched(head, before)
    assert head._version == version


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
@pytest.mark.parametrize("bad", ["missing", "not_its"])
def test_a_state_whose_keys_are_not_the_heads_is_refused_in_one_line_untouched(cls, bad):
    """With ``strict`` (torch's default) a state key missing, or one that is not the head's, is
    refused before anything loads (torch loads every other tensor and the extra state first, then
    raises in several lines); strict=False loads the keys both have."""
    head = cls(D, d, loss="sampled", negatives=dict(num=4, seed=1), generator=torch.Generator().manual_seed(0))
    other = cls(D, d, loss="sampled", negatives=dict(num=4, seed=1), generator=torch.Generator().manual_seed(1))
    step(other, *batch(6, d, D, 3, dtype=torch.float32))
    other.lr = 0.5
    saved = other.state_dict()
    key = "input_moment_weight"
    if bad == "missing":
        del saved[key]
    else:
        saved[key + "_"] = saved.pop(key) if cls is FactoredSphericalHead else saved[key]
    step(head, *batch(6, d, D, 3, dtype=torch.float32))
    lr, version = head.lr, head._version
    assert_load_refused(head, saved, "the state is not this head's: missing", head.negatives.generator,
                        error=RuntimeError)
    assert head.lr == lr != 0.5 and head._version == version
    head.load_state_dict(saved, strict=False)
    assert head.lr == 0.5 and torch.equal(head.state_dict()["Q" if cls is FactoredSphericalHead else "W"],
                                          other.state_dict()["Q" if cls is FactoredSphericalHead else "W"])


def test_a_state_of_another_number_of_classes_is_refused_in_one_line_untouched():
    """A whole V of a head with other classes is named as such (not as a sharded head's shard)."""
    head = FactoredSphericalHead(D + 1, d, generator=torch.Generator().manual_seed(0))
    saved = FactoredSphericalHead(D, d, generator=torch.Generator().manual_seed(1)).state_dict()
    before, version = state_of(head), head._version
    with pytest.raises(ValueError, match=f"V has {D} rows but this head has num_classes={D + 1}: it was saved "
                                         "by a head of another size") as err:
        head.load_state_dict(saved)
    assert "\n" not in str(err.value)
    assert_untouched(head, before)
    assert head._version == version


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
@pytest.mark.parametrize("attached", [False, True])
def test_a_trained_head_pickles_and_deep_copies_as_its_checkpoint(cls, attached):
    """``torch.save(head)`` and ``copy.deepcopy`` of a head that has trained (its last training
    forward is held weakly) or is attached with rows kept: the copy is the head's state and
    settings, detached, with nothing kept (warned), and it trains on as the head does after a step."""
    head = cls(D, d, generator=torch.Generator().manual_seed(0))
    step(head, *batch(6, d, D, 3, dtype=torch.float32))
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    if attached:
        head.attach(optimizer)
        step(head, *batch(6, d, D, 3, dtype=torch.float32))  # kept, not stepped
    copies = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        copies += [make(head) for make in COPIES]
    assert sum("rows kept" in str(w.message) for w in said) == (2 if attached else 0)
    if attached:
        head.detach()
    batches = [batch(6, d, D, 3, dtype=torch.float32) for _ in range(3)]
    for h in (head, *copies):
        assert h.pending.optimizer is None and h.pending.rows == 0
        for b in batches:
            step(h, *b)
    assert torch.equal(copies[0].weight(), head.weight()) and torch.equal(copies[1].weight(), head.weight())


def test_a_head_with_negatives_goes_to_a_spawned_process():
    """Both heads with their sampled classes (the default loss), handed to a spawned process as
    ``trainer=ddp_cpu``'s workers get the model: their generators travel as bytes (a
    ``torch.Generator`` pickled whole hands the process a freed tensor, and the process failed with
    "unable to resize file"), and the copies draw and train on as the heads do."""
    heads = torch.nn.ModuleList([cls(D, d, generator=torch.Generator().manual_seed(0))
                                 for cls in (FactoredSphericalHead, NaiveSphericalHead)])
    for head in heads:
        assert head.negatives is not None
        step(head, *batch(6, d, D, 3, dtype=torch.float32))
    copies = spawned(heads)
    batches = [batch(6, d, D, 3, dtype=torch.float32) for _ in range(3)]
    for head, twin in zip(heads, copies):
        for b in batches:
            assert torch.equal(step(twin, *b), step(head, *b))
        assert torch.equal(twin.weight(), head.weight())


def test_a_refused_tensors_only_state_leaves_u_inverse_as_it_was():
    """A state without its extra state (a saver of tensors only) marks U^-1 for a refresh only
    once it has loaded: refused, the head keeps its U^-1 fresh."""
    head = FactoredSphericalHead(D, d, generator=torch.Generator().manual_seed(0))
    saved = {k: v for k, v in head.state_dict().items() if k != "_extra_state"}
    saved["U"] = torch.zeros(2, 2)
    assert head.uinv_fresh
    with pytest.raises(ValueError, match="has shape"):
        head.load_state_dict(saved, strict=False)
    assert head.uinv_fresh
    del saved["U"]
    head.load_state_dict(saved, strict=False)
    assert not head.uinv_fresh


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
@pytest.mark.parametrize("entry", ["lr", "weight_decay", "negatives"])
def test_a_state_whose_settings_would_fail_after_its_tensors_loaded_is_refused_untouched(cls, entry):
    """The extra state's settings are set after the buffers have loaded: a bad lr, weight decay or
    generator state of the negatives is refused in one line before any buffer changes."""
    head = cls(D, d, generator=torch.Generator().manual_seed(0))
    saved = cls(D, d, generator=torch.Generator().manual_seed(1)).state_dict()
    extra = dict(saved["_extra_state"])
    extra[entry] = {"lr": float("nan"), "weight_decay": "x",
                    "negatives": {**extra["negatives"], "rng": torch.zeros(3, dtype=torch.uint8)}}[entry]
    saved["_extra_state"] = extra
    before, version, lr = state_of(head), head._version, head.lr
    with pytest.raises(ValueError, match=f"the state's {entry}") as err:
        head.load_state_dict(saved)
    assert "\n" not in str(err.value)
    assert_untouched(head, before)
    assert head._version == version and head.lr == lr


@pytest.mark.parametrize("cls", [FactoredSphericalHead, NaiveSphericalHead])
def test_a_head_left_on_the_meta_device_says_so_in_one_line(cls):
    """A head built on the meta device and called before ``to_empty`` (it holds no values)."""
    head = cls(num_classes=20, hidden_dim=4, device="meta")
    for call in (lambda: head(torch.randn(3, 4), torch.zeros(3, dtype=torch.long)),
                 lambda: head.topk(torch.randn(3, 4), 2)):
        with pytest.raises(RuntimeError, match=r"on the meta device.*to_empty") as err:
            call()
        assert "\n" not in str(err.value)
