"""The README is the user's manual: its commands, keys and example must be true."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import typing

from hongtu.config import Config
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def quick_start_commands() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "Quick start must hold exactly one code block"
    return [line for line in blocks[0].splitlines() if line.strip()]


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    cmds = quick_start_commands()
    assert len(cmds) == 2
    assert "hongtu train" in cmds[0] and "pytest" in cmds[1]
    assert cmds[1] in (REPO / ".ci" / "run").read_text()


def _keys(cls, prefix=""):
    for name, tp in typing.get_type_hints(cls).items():
        if dataclasses.is_dataclass(tp):
            yield from _keys(tp, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_every_config_key_is_documented():
    missing = [k for k in _keys(Config) if f"`{k}`" not in README]
    assert not missing, f"README's configuration reference lacks {missing}"


def test_readme_custom_layer_is_the_shipped_example():
    """The code shown in the README is the example file's class, line for line."""
    shown = README.split("## Custom layers", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    source = (REPO / "examples" / "edge_weighted_conv.py").read_text()
    for line in shown.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert line.rstrip() in source, f"README line not in the example: {line!r}"


def test_custom_layer_example_trains_through_the_command(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "hongtu", "train", "examples/custom_layer.yaml",
         f"output.dir={tmp_path}", "train.epochs=3"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "EdgeWeightedConv" in out.stdout and "epoch    3/3" in out.stdout
    assert (tmp_path / "model.pt").is_file()


def test_readme_update_vjp_example_gives_autograds_gradients():
    """The README's layer with its update's backward written out runs as shown
    and gives autograd's gradients bit for bit through ``GNN.update_backward``."""
    import torch

    from hongtu.engine.executor import _Rows
    from hongtu.nn import GNN, GNNLayer

    section = README.split("## Custom layers", 1)[1].split("\n## ", 1)[0]
    code = next(b for b in re.findall(r"```python\n(.*?)```", section, re.S)
                if "def update_vjp" in b)
    scope = {"torch": torch, "GNNLayer": GNNLayer}
    exec(code, scope)
    torch.manual_seed(0)
    n = 12
    model = GNN([scope["SumRoot"](5, 8), scope["SumRoot"](8, 3)], dropout=0.5).double()
    assert model.writes_update_backward(0) and model.writes_update_backward(1)
    for l, width in ((0, 5), (1, 8)):
        a, own = torch.randn(n, width, dtype=torch.float64), torch.randn(n, width,
                                                                         dtype=torch.float64)
        g = torch.randn(n, model.row_widths()[l + 1], dtype=torch.float64)
        rows = _Rows(torch.arange(n))
        model.zero_grad(set_to_none=True)
        a_ref, x_ref = a.clone().requires_grad_(), own.clone().requires_grad_()
        model.step_update(l, rows, a_ref, x_ref, 3, 4).backward(g)
        want = [p.grad.clone() for p in model.layers[l].parameters()]
        model.zero_grad(set_to_none=True)
        x_got = own.clone().requires_grad_()
        done, g_a = model.update_backward(l, rows, a, g, 4, True, x_got, 3)
        assert done and torch.equal(g_a, a_ref.grad) and torch.equal(x_got.grad, x_ref.grad)
        assert all(torch.equal(w, p.grad) for w, p in zip(want, model.layers[l].parameters()))
