"""HeadTiming in a plain LightningModule of a user's own (the head under another name,
no LanguageModel): it logs the step time, tokens/s and the head's share of the step."""
import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lst_lightning.app.callbacks import HeadTiming
from lst_lightning.spherical import FactoredSphericalHead


class UserModule(pl.LightningModule):
    def __init__(self, step="autograd"):
        super().__init__()
        self.body = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(16, 8))
        self.lm_head = FactoredSphericalHead(num_classes=50, hidden_dim=8, loss="zloss", lr=0.5, step=step)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.lm_head(self.body(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.body.parameters(), lr=0.1)


@pytest.mark.parametrize("step", ["autograd", "fused"])
def test_head_timing_in_a_users_module(tmp_path, step):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randint(0, 50, (96, 2), generator=g),
                                          torch.randint(0, 50, (96,), generator=g))
    timing = HeadTiming(every=2)
    trainer = pl.Trainer(max_steps=12, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timing],
                         default_root_dir=tmp_path)
    trainer.fit(UserModule(step), torch.utils.data.DataLoader(data, batch_size=8))
    m = trainer.callback_metrics
    assert 0 < float(m["train/head_share"]) < 1 and float(m["train/tokens_per_s"]) > 0
    t = timing.totals
    assert t["steps"] == 4 and t["tokens"] == 32  # steps 4, 6, 8, 10 (0 and 2 are warm-up)
    assert 0 < t["head_s"] < t["step_s"]


def test_head_timing_needs_exactly_one_head(tmp_path):
    class TwoHeads(UserModule):
        def __init__(self):
            super().__init__()
            self.other = FactoredSphericalHead(num_classes=50, hidden_dim=8)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[HeadTiming()],
                         default_root_dir=tmp_path)
    data = torch.utils.data.TensorDataset(torch.zeros(8, 2, dtype=torch.long), torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="holds 2 output heads"):
        trainer.fit(TwoHeads(), torch.utils.data.DataLoader(data, batch_size=8))
