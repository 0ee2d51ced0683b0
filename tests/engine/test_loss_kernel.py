"""The output kernel (loss, accuracy counts, loss gradient) equals the torch ops it replaces."""

import pytest
import torch

from hongtu.engine.executor import _output_torch

pytestmark = pytest.mark.gpu


def _case(n, classes, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, generator=g)
    if ties:  # whole rows of equal logits and rows with two equal maxima
        logits[::7] = 0.5
        logits[1::7, 3 % classes] = logits[1::7, 0] = 9.0
    y = torch.randint(0, classes, (n,), generator=g)
    y[::11] = -1  # unlabelled rows (in no split)
    splits = torch.zeros(n, 3, dtype=torch.bool)
    pick = torch.randint(0, 4, (n,), generator=g)  # 3: no split
    splits[pick < 3, :] = torch.nn.functional.one_hot(pick[pick < 3], 3).bool()
    splits[y < 0] = False
    cols = y.clamp(0, classes - 1).unsqueeze(1)
    return logits, y, cols, splits


@pytest.mark.parametrize("n,classes", [(1, 2), (1000, 47), (4099, 40), (300, 1000),
                                       (77, 3000)])
@pytest.mark.parametrize("train", [True, False])
def test_kernel_matches_torch_ops(n, classes, train):
    pytest.importorskip("triton")
    from hongtu.engine._triton_loss import output_triton

    logits, y, cols, splits = _case(n, classes, n + classes, ties=True)
    num_train = 12345
    ref_acc = torch.zeros(7, dtype=torch.float64)
    ref = _output_torch(logits, y, cols, splits, ref_acc, num_train, train)
    d = torch.device("cuda")
    acc = torch.zeros(7, dtype=torch.float64, device=d)
    # into a slice of a larger table, as the engine writes a chunk's rows
    table = torch.full((n + 5, classes), float("nan"), device=d)
    grad = table[2:n + 2] if train else None
    output_triton(logits.to(d), y.to(d), cols.to(d), splits.to(d), acc, num_train, grad)
    acc = acc.cpu()
    assert torch.equal(acc[1:], ref_acc[1:])  # counts exactly (argmax: first maximum)
    assert acc[0].item() == pytest.approx(ref_acc[0].item(), rel=1e-6, abs=1e-12)
    if train:
        torch.testing.assert_close(grad.cpu(), ref, rtol=1e-5, atol=1e-9)
        assert table[:2].isnan().all() and table[n + 2:].isnan().all()  # nothing else written
    else:
        assert ref is None
