"""The full softmax head (softmax.py) against a dense log-softmax reference."""
import pytest
import torch
import torch.nn.functional as F

from lst_lightning.baselines import SoftmaxHead

from baseline_cases import D, d, dense_loss, grads, m, make_targets


@pytest.mark.parametrize("chunked,chunk_elements", [(True, 1 << 24), (True, 2 * D), (False, 1)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("K", [1, 3])
def test_softmax_matches_dense(chunked, chunk_elements, bias, K):
    """Against logits + log_softmax; chunk_elements = 2 D makes chunks of 2 rows."""
    head = SoftmaxHead(num_classes=D, hidden_dim=d, bias=bias, chunked=chunked, chunk_elements=chunk_elements)
    if bias:
        torch.nn.init.normal_(head.bias)
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(K)[:, 0] if K == 1 else make_targets(K)
    params = [h, *head.parameters()]
    got = head(h, t)
    ref = dense_loss(F.log_softmax(F.linear(h, head.weight, head.bias), 1), t)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, *params), grads(ref, *params)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("K", [1, 3])
def test_softmax_on_a_torch_without_linear_cross_entropy(monkeypatch, bias, K):
    """torch before 2.13 (2.11, 2.12) has no F.linear_cross_entropy: the
    head computes the same loss and gradients unfused."""
    head = SoftmaxHead(num_classes=D, hidden_dim=d, bias=bias)
    if bias:
        torch.nn.init.normal_(head.bias)
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(K)[:, 0] if K == 1 else make_targets(K)
    params = [h, *head.parameters()]
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    got = head(h, t)
    want = dense_loss(F.log_softmax(F.linear(h, head.weight, head.bias), 1), t)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads(got, *params), grads(want, *params)):
        torch.testing.assert_close(a, b)


def test_softmax_weighted_targets_and_cosine():
    head = SoftmaxHead(num_classes=D, hidden_dim=d, cosine_scale=3.0)
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(2)
    val = torch.rand(m, 2)
    got = head(h, t, val)
    logits = 3.0 * F.normalize(h, dim=1) @ F.normalize(head.weight, dim=1).T
    ref = dense_loss(F.log_softmax(logits, 1), t, val)
    torch.testing.assert_close(got, ref)
    for a, b in zip(grads(got, h, head.weight), grads(ref, h, head.weight)):
        torch.testing.assert_close(a, b)


def test_softmax_scores_log_prob_and_rank():
    head = SoftmaxHead(num_classes=D, hidden_dim=d, bias=True)
    h = torch.randn(m, d)
    full = torch.cat([s for _, s in head.score_chunks(h, chunk_size=4)], 1)
    torch.testing.assert_close(full, F.linear(h, head.weight, head.bias))
    t = make_targets(1)[:, 0].clamp(min=0)
    torch.testing.assert_close(head.log_prob(h, t), F.log_softmax(full, 1).gather(1, t[:, None])[:, 0])
    rank = 1 + (full > full.gather(1, t[:, None])).sum(1)
    assert torch.equal(head.target_rank(h, t), rank)  # no ties with random floats


def test_softmax_optional_impls_fail_clearly():
    try:
        import liger_kernel  # noqa: F401, PLC0415
    except ImportError:
        with pytest.raises(ImportError, match="optional package 'liger-kernel'"):
            SoftmaxHead(num_classes=D, hidden_dim=d, impl="liger")
    else:
        with pytest.raises(ValueError, match="CUDA"):  # installed, but this is a CPU tensor
            SoftmaxHead(num_classes=D, hidden_dim=d, impl="liger")(torch.randn(m, d), make_targets(1)[:, 0])
    with pytest.raises(ValueError, match="impl"):
        SoftmaxHead(num_classes=D, hidden_dim=d, impl="fast")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("K,weighted", [(1, False), (3, False), (2, True)])
def test_softmax_cce_matches_torch_on_cpu(bias, K, weighted):
    """impl="cce" off CUDA runs cut-cross-entropy's torch path (a dev dependency), with the
    bias folded into W: the same loss and gradients as impl="torch"."""
    pytest.importorskip("cut_cross_entropy")
    head = SoftmaxHead(num_classes=D, hidden_dim=d, impl="cce", bias=bias)
    if bias:
        torch.nn.init.normal_(head.bias)
    ref = SoftmaxHead(num_classes=D, hidden_dim=d, bias=bias)
    ref.load_state_dict(head.state_dict())
    h = torch.randn(m, d, requires_grad=True)
    t = make_targets(K)[:, 0] if K == 1 else make_targets(K)
    val = torch.rand(m, K) if weighted else None
    with torch.compiler.set_stance("force_eager"):  # its torch.compile'd function, run eagerly: seconds saved
        got = head(h, t, val)
        g_got = grads(got, h, *head.parameters())
    want = ref(h, t, val)
    torch.testing.assert_close(got, want)
    for a, b in zip(g_got, grads(want, h, *ref.parameters())):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["liger", "cce"])
def test_softmax_optional_impls_match_torch_on_cuda(impl):
    pytest.importorskip({"liger": "liger_kernel", "cce": "cut_cross_entropy"}[impl])
    head = SoftmaxHead(num_classes=1000, hidden_dim=64, impl=impl, device="cuda")
    ref = SoftmaxHead(num_classes=1000, hidden_dim=64, device="cuda")
    ref.load_state_dict(head.state_dict())
    h = torch.randn(64, 64, device="cuda")
    t = torch.randint(0, 1000, (64, 2), device="cuda")
    t[0, 1] = -1
    for tt in (t[:, 0], t):
        torch.testing.assert_close(head(h, tt), ref(h, tt), rtol=2e-3, atol=2e-3)


def test_cce_refuses_a_weight_past_its_32_bit_offsets_on_cuda():
    """cut-cross-entropy's CUDA kernels index W with 32 bits (an illegal memory access at
    D = 2e7, d = 512 on an H200): refused in one line before any launch; its CPU path and a W
    within the bound pass."""
    from lst_lightning.baselines.softmax import CCE_MAX_ELEMENTS, check_cce_size

    with pytest.raises(ValueError, match="at most 2\\^31 - 1 weight elements"):
        check_cce_size(20_000_000 * 512, on_cuda=True)
    check_cce_size(20_000_000 * 512, on_cuda=False)
    check_cce_size(CCE_MAX_ELEMENTS, on_cuda=True)
    with pytest.raises(ValueError):
        check_cce_size(CCE_MAX_ELEMENTS + 1, on_cuda=True)
