"""The numba dropout kernel (CPU) and the tensor-op hash (GPU) agree bit for bit."""

import pytest
import torch

from hongtu.nn import ops


@pytest.mark.parametrize("seed", [0, 1, 12345678901234, 2**62 + 77])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_kernel_matches_tensor_ops(seed, p):
    ids = torch.randperm(200_000)[:3000]
    a = ops.dropout_mask(ids, 37, p, seed)
    b = ops._dropout_mask_torch(ids, 37, int(p * 2**32), seed)
    assert torch.equal(a, b)
    assert abs(a.float().mean().item() - (1 - p)) < 0.02


def test_huge_ids_do_not_collide():
    # key = id * width + col crosses 2^32: the high word must enter the hash.
    ids = torch.tensor([0, 2**32 // 64, 2**33, 2**40], dtype=torch.int64)
    m = ops.dropout_mask(ids, 64, 0.5, 7)
    assert len({tuple(r.tolist()) for r in m}) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 12345678901234, 2**62 + 77])
def test_triton_kernel_matches_cpu_kernel(seed):
    pytest.importorskip("triton")
    from hongtu.nn._triton_dropout import dropout_mask_triton

    ids = torch.randint(0, 2**34, (5000,), dtype=torch.int64)
    cpu = ops.dropout_mask(ids, 37, 0.3, seed)
    gpu = dropout_mask_triton(ids.cuda(), 37, int(0.3 * 2**32), seed).cpu()
    assert torch.equal(cpu, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_fused_dropout_matches_mask_then_scale(p):
    """The one-pass GPU dropout equals ``(x * mask) * scale`` bit for bit, both ways,
    signed zeros and NaN included."""
    pytest.importorskip("triton")
    ids = torch.randint(0, 2**34, (3001,), dtype=torch.int64).cuda()
    x = torch.randn(3001, 37, device="cuda")
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -0.0, -1e-30, 3e38])
    x.requires_grad_(True)
    y = ops.dropout(x, ids, p, 77)
    assert y.grad_fn is not None and "Fused" in type(y.grad_fn).__name__
    mask = ops._dropout_mask_torch(ids, 37, int(p * 2**32), 77)
    ref = (x.detach() * mask).mul_(1.0 / (1.0 - p))
    assert torch.equal(y.detach().view(torch.int32), ref.view(torch.int32))
    g = torch.randn_like(y)
    y.backward(g)
    ref_grad = (g * mask).mul_(1.0 / (1.0 - p))
    assert torch.equal(x.grad.view(torch.int32), ref_grad.view(torch.int32))
