"""The transformer body: shapes, causality (no position sees a later token) and bad settings."""
import pytest
import torch

from lst_lightning.models import GPT


def _body(**kw):
    torch.manual_seed(0)
    return GPT(vocab_size=50, context_size=12, embed_dim=16, num_layers=2, num_heads=4, hidden_dim=8, **kw).double()


def test_shapes_and_shorter_sequences():
    body = _body()
    x = torch.randint(0, 50, (3, 12))
    assert body(x).shape == (3, 12, 8)
    assert body(x[:, :5]).shape == (3, 5, 8)
    assert GPT.reads_sequences


def test_a_later_token_changes_no_earlier_hidden_state():
    body = _body().eval()
    x = torch.randint(0, 50, (4, 12))
    for t in (0, 5, 11):
        y = x.clone()
        y[:, t] = (y[:, t] + 1 + torch.arange(4)) % 50
        hx, hy = body(x), body(y)
        torch.testing.assert_close(hx[:, :t], hy[:, :t], rtol=0, atol=1e-12)
        assert (hx[:, t] - hy[:, t]).abs().max() > 1e-6  # the changed position itself does see it


def test_matches_an_explicit_masked_attention():
    """The fused causal attention against softmax(QK^T/sqrt(h) + mask) V written out."""
    body = _body().eval()
    attn = body.blocks[0].attn
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    q, k, v = attn.qkv(x).view(2, 7, 3, 4, 4).permute(2, 0, 3, 1, 4)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    w = (q @ k.transpose(-1, -2) / 2.0).masked_fill(~mask, float("-inf")).softmax(-1)
    want = attn.out((w @ v).transpose(1, 2).reshape(2, 7, 16))
    torch.testing.assert_close(attn(x), want)


def test_sparse_embedding_gives_row_sparse_gradients():
    body = _body(sparse_embedding=True)
    body(torch.tensor([[1, 2, 2]])).sum().backward()
    g = body.input_embedding.weight.grad
    assert g.is_sparse and set(g.coalesce().indices()[0].tolist()) == {1, 2}


def test_bad_settings():
    with pytest.raises(ValueError, match="num_heads"):
        GPT(vocab_size=10, context_size=4, embed_dim=10, num_heads=4)
    with pytest.raises(ValueError, match="context_size"):
        _body()(torch.zeros(1, 13, dtype=torch.long))


@pytest.mark.parametrize("setting, value, match", [
    ("embed_dim", 0, "embed_dim must be a positive int, got 0"),
    ("num_heads", 0, "num_heads must be a positive int"),
    ("mlp_ratio", 0, "mlp_ratio must be a positive int"),
    ("hidden_dim", -1, "hidden_dim must be a positive int"),
    ("num_layers", -1, r"num_layers must be an int >= 0"),
    ("dropout", 1.0, r"dropout must be a probability in \[0, 1\)"),
    ("embed_dim", 16.0, "embed_dim must be a positive int, got 16.0"),
])
def test_a_setting_that_builds_no_working_body_is_refused_in_one_line(setting, value, match):
    """A zero width built a body whose output does not depend on its tokens (``embed_dim=0``,
    ``mlp_ratio=0``), and lst-train trained it; a zero head count divided by zero."""
    kw = dict(vocab_size=50, context_size=12, embed_dim=16, num_layers=2, num_heads=4, hidden_dim=8)
    with pytest.raises(ValueError, match=match) as e:
        GPT(**{**kw, setting: value})
    assert "\n" not in str(e.value)
    GPT(**{**kw, "num_layers": 0})  # no block: embeddings, the norm and the projection, a valid body
