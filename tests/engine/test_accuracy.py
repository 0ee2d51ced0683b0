"""Accuracy on real data: published Planetoid numbers, out of core.

GCN (Kipf & Welling 2017) on Cora: 81.5%; GAT (Veličković et al. 2018): 83.0 ± 0.7%.
The runs use ../shared/data/cora.npz and skip when it is absent.
"""

from __future__ import annotations

import statistics

import pytest

from hongtu.config import load_config
from hongtu.engine.trainer import Trainer
from tests.conftest import REPO, shared_dataset


def final_test_accuracy(config: str, tmp_path, overrides: list[str]) -> float:
    path = shared_dataset("cora")
    cfg = load_config(REPO / "configs" / config,
                      [f"data.path={path}", f"output.dir={tmp_path}",
                       "train.eval_every=1000", *overrides])
    trainer = Trainer(cfg, overwrite=True, out=lambda s: None)
    records = trainer.fit(progress=False)
    return records[-1]["test_acc"]


@pytest.mark.parametrize("chunks", [1, 8])
def test_gcn_cora_reaches_published_accuracy(tmp_path, chunks):
    accs = [final_test_accuracy("cora_gcn.yaml", tmp_path / str(seed),
                                [f"engine.chunks={chunks}", f"train.seed={seed}"])
            for seed in range(3)]
    print(f"GCN Cora, {chunks} chunk(s): test accuracy {accs}, mean {statistics.mean(accs):.4f}")
    assert statistics.mean(accs) >= 0.805, accs


@pytest.mark.slow
def test_gat_cora_reaches_published_accuracy(tmp_path):
    accs = [final_test_accuracy("cora_gat.yaml", tmp_path / str(seed),
                                ["engine.chunks=8", f"train.seed={seed}"])
            for seed in range(3)]
    print(f"GAT Cora, 8 chunks: test accuracy {accs}, mean {statistics.mean(accs):.4f}")
    assert statistics.mean(accs) >= 0.81, accs
