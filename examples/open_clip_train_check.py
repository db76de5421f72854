"""open_clip's own trainer, with open_clip's loss and with infcl's (``python -m infcl.open_clip_train``), on CPU.

    python examples/open_clip_train_check.py [--worlds 1 2] [--steps 8] [--siglip] [--local-loss --gather-with-grad]
                                             [--distill]

needs an environment where ``import open_clip_train.main`` works (open_clip_torch with its training
dependencies, torchvision; docs/integrations.md#open_clips-trainer says how one was built here). It writes a tiny
model config (``local-dir:``) and a CSV dataset of random images and random captions to a temporary folder, then
for each world size runs ``open_clip_train.main`` twice under torchrun on gloo ranks, the same arguments and seed:
with open_clip's ``create_loss`` and through :func:`infcl.open_clip_train.main`. It prints every step's logged
loss of both and the largest difference between their final weights, and exits 1 when the weights differ by more
than fp32 noise or the logged losses differ. ``--distill`` distills from a teacher of the same tiny architecture
(random init, another seed, saved as a checkpoint; ``--distill-model`` / ``--distill-pretrained``), and the
logged distillation losses are compared too.

open_clip's synthetic dataset (``--dataset-type synthetic``) is not used: every sample is the same blank image and
caption, so every logit is equal, the loss stays at log(batch) and no feature gets a gradient.

open_clip_train wraps the model in DDP with ``device_ids=[device]``, which torch refuses for a CPU module; the
worker (``--worker``) drops ``device_ids`` for CPU modules before it starts the trainer, in both runs alike.
"""

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile

import torch

HERE = os.path.abspath(__file__)
# The model: two-layer ViT on 32 x 32 images and a two-layer text tower, 32-dimensional embeddings.
TINY_MODEL = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
WORDS = "red green blue small large cat dog car tree house river stone cloud bird fish lamp".split()
GLOBAL_BATCH = 16
# Relative difference of the final weights (2-norm over the whole model, and logit_scale) that counts as fp32
# noise after a few SGD steps. The check trains with SGD (timm's, which open_clip_train takes as --opt timm/sgd)
# rather than open_clip's default AdamW, whose normalized steps hide a gradient's scale and turn rounding noise
# into steps of ~lr: a parameter whose exact gradient is zero (the attention's key bias, which cancels in the
# softmax) then differs at the lr scale between any two summation orders, open_clip's own included.
# Pass --opt adamw --lr 1e-3 to train as open_clip does by default (the logged losses still agree).
WEIGHT_RTOL = 1e-5
# open_clip logs losses to 5 significant digits: two runs equal to fp32 noise may still round one unit apart.
LOGGED_RTOL = 2e-4
LOSS_LINE = re.compile(r"Train Epoch: (\d+) \[\s*(\d+)/.*?Contrastive_loss: ([0-9.eE+-]+)")
DISTILL_LINE = re.compile(r"Train Epoch: .*?Distill_loss: ([0-9.eE+-]+)")


def make_data(root: str, samples: int) -> str:
    """``samples`` random 32 x 32 PNG images with random four-word captions, and open_clip's tab-separated CSV."""
    from PIL import Image

    gen = random.Random(0)
    rows = ["filepath\ttitle"]
    for i in range(samples):
        pixels = bytes(gen.randrange(256) for _ in range(32 * 32 * 3))
        path = os.path.join(root, f"{i}.png")
        Image.frombytes("RGB", (32, 32), pixels).save(path)
        rows.append(f"{path}\t{' '.join(gen.choice(WORDS) for _ in range(4))}")
    csv = os.path.join(root, "train.csv")
    with open(csv, "w") as f:
        f.write("\n".join(rows) + "\n")
    return csv


def make_teacher(root: str, model_dir: str) -> list:
    """The trainer arguments that distill from a random-init teacher of the tiny architecture (another seed)."""
    import open_clip

    torch.manual_seed(1)
    path = os.path.join(root, "teacher.pt")
    torch.save({"state_dict": open_clip.create_model(f"local-dir:{model_dir}").state_dict()}, path)
    return ["--distill-model", f"local-dir:{model_dir}", "--distill-pretrained", path]


def make_model_dir(root: str) -> str:
    model_dir = os.path.join(root, "tiny-clip")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": TINY_MODEL, "preprocess_cfg": {}}, f)
    return model_dir


def trainer_args(root: str, csv: str, model_dir: str, world: int, steps: int, name: str, extra) -> list:
    per_epoch = 4  # steps per epoch: the CSV holds 4 global batches
    return [
        "--model",
        f"local-dir:{model_dir}",
        "--train-data",
        csv,
        "--dataset-type",
        "csv",
        "--batch-size",
        str(GLOBAL_BATCH // world),
        "--epochs",
        str(steps // per_epoch),
        "--opt",
        "timm/sgd",
        "--lr",
        "0.05",
        "--warmup",
        "1",
        "--wd",
        "0.1",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--seed",
        "0",
        "--log-every-n-steps",
        "1",
        "--save-frequency",
        str(steps // per_epoch),
        "--logs",
        os.path.join(root, "logs"),
        "--name",
        name,
        "--report-to",
        "",
        *extra,
    ]


def run(world: int, impl: str, args: list) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        HERE,
        "--worker",
        impl,
        "--",
        *args,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{impl} on {world} rank(s) failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")


def logged_losses(root: str, name: str) -> list:
    """Every step's logged contrastive loss (and distillation loss, when logged) on rank 0."""
    with open(os.path.join(root, "logs", name, "out.log")) as f:
        log = f.read()
    contrastive = [float(m.group(3)) for m in LOSS_LINE.finditer(log)]
    return contrastive + [float(m.group(1)) for m in DISTILL_LINE.finditer(log)]


def final_weights(root: str, name: str) -> dict:
    folder = os.path.join(root, "logs", name, "checkpoints")
    (last,) = [f for f in os.listdir(folder) if f.startswith("epoch_")] or [None]
    state = torch.load(os.path.join(folder, last), map_location="cpu", weights_only=False)["state_dict"]
    return {k.removeprefix("module."): v for k, v in state.items()}


def compare(root: str, world: int, steps: int, extra) -> bool:
    csv, model_dir = os.path.join(root, "train.csv"), os.path.join(root, "tiny-clip")
    names = {impl: f"{impl}-w{world}" for impl in ("open_clip", "infcl")}
    for impl, name in names.items():
        run(world, impl, trainer_args(root, csv, model_dir, world, steps, name, extra))
    theirs, ours = (logged_losses(root, names[i]) for i in ("open_clip", "infcl"))
    print(f"world {world}: logged loss per step (rank 0; contrastive, then distillation if any), open_clip / infcl")
    for step, (a, b) in enumerate(zip(theirs, ours)):
        print(f"  {step % steps}: {a:.5g}  {b:.5g}")
    w_theirs, w_ours = (final_weights(root, names[i]) for i in ("open_clip", "infcl"))
    diff = sum(float((w_ours[k] - w).double().pow(2).sum()) for k, w in w_theirs.items()) ** 0.5
    norm = sum(float(w.double().pow(2).sum()) for w in w_theirs.values()) ** 0.5
    # open_clip clamps logit_scale (the log of the scale) to [0, log 100]: relative to 1 where it reached 0.
    scale_theirs = w_theirs["logit_scale"]
    scale_rel = float((w_ours["logit_scale"] - scale_theirs).abs() / scale_theirs.abs().clamp_min(1))
    print(
        f"  final weights: |ours - theirs| / |theirs| = {diff / norm:.2e} over the model, {scale_rel:.2e} for "
        f"logit_scale; tolerance {WEIGHT_RTOL:g}"
    )
    same_curve = (
        len(theirs) == len(ours)
        and len(theirs) % steps == 0
        and all(math.isclose(a, b, rel_tol=LOGGED_RTOL) for a, b in zip(theirs, ours))
    )
    trained = theirs[0] != theirs[steps - 1]  # a run whose loss never moved would compare equal trivially
    ok = same_curve and trained and diff / norm <= WEIGHT_RTOL and scale_rel <= WEIGHT_RTOL
    print(f"  {'same' if ok else 'DIFFERENT'}")
    return ok


def worker(impl: str, argv: list) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel

    class CPUDistributedDataParallel(ddp):
        def __init__(self, module, device_ids=None, **kwargs):
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            super().__init__(module, device_ids=None if on_cpu else device_ids, **kwargs)

    torch.nn.parallel.DistributedDataParallel = CPUDistributedDataParallel
    if impl == "infcl":
        from infcl.open_clip_train import main

        main(argv)
    else:
        from open_clip_train.main import main

        main(argv)


def parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=8, help="a multiple of 4 (steps per epoch)")
    parser.add_argument("--distill", action="store_true", help="distill from a random-init teacher checkpoint")
    parser.add_argument("--worker", choices=("open_clip", "infcl"), help=argparse.SUPPRESS)
    known, extra = parser.parse_known_args()
    return known, [a for a in extra if a != "--"]


def main() -> None:
    known, extra = parse()
    if known.worker:
        worker(known.worker, extra)
        return
    os.environ.setdefault("INFCL_BACKEND", "torch")  # the native kernel would compile first for this torch
    with tempfile.TemporaryDirectory() as root:
        make_data(root, 4 * GLOBAL_BATCH)
        model_dir = make_model_dir(root)
        if known.distill:
            extra = extra + make_teacher(root, model_dir)
        results = [compare(root, world, known.steps, extra) for world in known.worlds]
    sys.exit(0 if all(results) else 1)


if __name__ == "__main__":
    main()
