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


def _compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        return sum(len(c[0]) for c in caches.values())
    pytest.skip("this Triton keeps no inspectable kernel cache")


@pytest.mark.gpu
def test_new_seeds_compile_no_new_kernels():
    """Seeds change every epoch and layer; the kernels must not be compiled again for
    each (Triton types int arguments by value and specialises on divisibility)."""
    pytest.importorskip("triton")
    from hongtu.nn import _triton_dropout as K

    ids = torch.arange(1000, device="cuda")
    x = torch.randn(1000, 48, device="cuda")
    kernels = (K._dropout_kernel, K._mask_kernel, K._dropout_rows_kernel)

    def run(seed, n=1000):
        K.dropout_triton(x[:n], ids[:n], int(0.5 * 2**32), seed, 2.0)
        K.dropout_mask_triton(ids[:n], 48, int(0.5 * 2**32), seed)
        K.dropout_rows_triton(x[:n], ids[:n], int(0.5 * 2**32), seed, 2.0, x, ids[:n],
                              x_at=ids[:n])

    run(1)
    before = [_compiled_variants(k) for k in kernels]
    for seed, n in zip((0, 16, 2**31 + 5, 2**32 + 16, 2**63 - 1, 12345678901234),
                       (1000, 999, 17, 512, 1, 640)):  # (a step brings any number of rows)
        run(seed, n)
    assert [_compiled_variants(k) for k in kernels] == before


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_fused_relu_dropout_matches_relu_then_dropout(p):
    """ReLU and dropout as one kernel each way: the values of ``dropout(relu(x))``
    and of its gradient, zeros, NaN and infinities included."""
    pytest.importorskip("triton")
    ids = torch.randint(0, 2**34, (3001,), dtype=torch.int64).cuda()
    x0 = torch.randn(3001, 37, device="cuda")
    x0[0, :6] = torch.tensor([float("nan"), float("inf"), -0.0, 0.0, -float("inf"), -1e-30])
    x = x0.clone().requires_grad_(True)
    y = ops.relu_dropout(x, ids, p, 77)
    assert "Fused" in type(y.grad_fn).__name__
    ref_x = x0.clone().requires_grad_(True)
    mask = ops._dropout_mask_torch(ids, 37, int(p * 2**32), 77)
    ref = (torch.relu(ref_x) * mask).mul(1.0 / (1.0 - p))
    torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)
    g = torch.randn_like(y)
    y.backward(g)
    ref.backward(g)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=0, equal_nan=True)
    # off, or without Triton's conditions: plain relu then dropout
    torch.testing.assert_close(ops.relu_dropout(x0, ids, p, 77, training=False),
                               torch.relu(x0), rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 37, 256, 300, 602])
def test_triton_tiles_match_cpu_kernel_at_any_width(width):
    """Rows wider than a tile span several column programs; keys cross 2^32."""
    pytest.importorskip("triton")
    from hongtu.nn import _triton_dropout as K

    seed, p = 2**62 + 77, 0.3
    ids = torch.randint(0, 2**34, (1001,), dtype=torch.int64)
    mask = ops.dropout_mask(ids, width, p, seed)
    assert torch.equal(K.dropout_mask_triton(ids.cuda(), width, int(p * 2**32), seed).cpu(),
                       mask)
    x = torch.randn(1001, width)
    y = K.dropout_triton(x.cuda(), ids.cuda(), int(p * 2**32), seed, 1 / (1 - p)).cpu()
    assert torch.equal(y, (x * mask).mul_(1 / (1 - p)))
    # rows read at x_at, written at at
    x_at, at = torch.randperm(1001)[:500], torch.randperm(700)[:500]
    out = torch.zeros(700, width).cuda()
    K.dropout_rows_triton(x.cuda(), ids[:500].cuda(), int(p * 2**32), seed, 1 / (1 - p),
                          out, at.cuda(), x_at=x_at.cuda())
    ref = torch.zeros(700, width)
    ref[at] = (x[x_at] * mask[:500]).mul_(1 / (1 - p))
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_relu_dropout_grad_is_autograds(p, training, device):
    """The gradient of relu_dropout without a graph equals autograd's bit for bit,
    at NaN and signed zeros too (ReLU's backward passes a NaN's gradient)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(200, 37, generator=gen, dtype=dtype)
    x[0, :4] = torch.tensor([float("nan"), -0.0, 0.0, 1e-30])
    x = x.to(device).requires_grad_()
    ids = torch.randint(0, 2**34, (200,), generator=gen).to(device)
    g = torch.randn(200, 37, generator=gen, dtype=dtype).to(device)
    (want,) = torch.autograd.grad(ops.relu_dropout(x, ids, p, 77, training), x, g)
    got = ops.relu_dropout_grad(g, x.detach(), ids, p, 77, training)
    assert torch.equal(got, want)
    assert (got == 0).any()
    if p == 0.0 or not training:
        assert got[0, 0] == g[0, 0]
