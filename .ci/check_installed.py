"""An installed infcl (from its wheel, not a checkout) builds its native kernel and computes the right loss.

Run by .ci/check_wheel with a fresh virtual environment's python, from a folder outside the checkout, with
TORCH_EXTENSIONS_DIR pointing at an empty folder, so the build really happens here.
"""

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

import infcl
from infcl.backends.native import build as native_build

SCALE = 14.3  # exp(2.659), CLIP's initial logit scale
TOLERANCE = (1e-5, 1e-4)  # (atol, rtol) for float32 against the float64 vanilla loss


def infcl_command(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "infcl", *args], capture_output=True, text=True)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result


def check_installed_package() -> None:
    package = Path(infcl.__file__).parent
    assert "site-packages" in package.parts, f"infcl was imported from {package}, not from the installed wheel"
    assert infcl.__version__ == metadata.version("infcl"), (infcl.__version__, metadata.version("infcl"))
    assert native_build.sources_dir() == package / "_csrc", native_build.sources_dir()


def check_build_messages() -> None:
    """Report says 'not built yet'; the build prints its start and end lines; a second build is silent."""
    before = infcl_command()
    assert before.returncode == 0 and "not built yet" in before.stdout
    built = infcl_command("build")
    assert built.returncode == 0, built.stderr
    lines = built.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("infcl: building the native CPU kernel") and "once per machine" in lines[0], lines[0]
    assert str(native_build.sources_dir()) in lines[0], lines[0]
    assert lines[1].startswith("infcl: built the native CPU kernel in "), lines[1]
    again = infcl_command("build")
    assert again.returncode == 0 and again.stderr == "", again.stderr
    after = infcl_command()
    assert "  cpu        on cpu:   available" in after.stdout, after.stdout


def vanilla_clip_loss(q, k, scale):
    logits = scale * q @ k.T
    labels = torch.arange(q.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def check_loss_against_vanilla() -> None:
    """The symmetric loss and its gradients on the native backend against F.cross_entropy in float64."""
    gen = torch.Generator().manual_seed(0)
    q64 = F.normalize(torch.randn(70, 40, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    k64 = F.normalize(torch.randn(70, 40, generator=gen, dtype=torch.float64), dim=-1).requires_grad_()
    q32, k32 = q64.detach().float().requires_grad_(), k64.detach().float().requires_grad_()
    ours = infcl.cal_inf_loss(q32, k32, scale=SCALE, symmetric=True, backend="cpu")
    ours.backward()
    truth = vanilla_clip_loss(q64, k64, SCALE)
    truth.backward()
    atol, rtol = TOLERANCE
    for name, got, want in (("loss", ours, truth), ("dq", q32.grad, q64.grad), ("dk", k32.grad, k64.grad)):
        torch.testing.assert_close(
            got.double(), want.detach(), atol=atol, rtol=rtol, msg=lambda m, name=name: f"{name}: {m}"
        )
    print(f"native loss {ours.item():.6f} = vanilla float64 {truth.item():.6f}; gradients match")


if __name__ == "__main__":
    check_installed_package()
    check_build_messages()
    check_loss_against_vanilla()
    print("installed wheel: OK")
