"""Train a small offline SentenceTransformer with SentenceTransformerTrainer and a cached
MultipleNegativesRankingLoss: infcl's against sentence-transformers' own, on the same run.

    python examples/train_sentence_transformer.py                              # batch 4096, mini-batch 64, 5 steps
    python examples/train_sentence_transformer.py --batch-size 256 --steps 2   # a quick check
    torchrun --nproc_per_node=2 examples/train_sentence_transformer.py --loss infcl --gather

On a busy CPU machine add ``--threads 1``: with more threads than free cores torch's threads spend
most of a step waiting for each other, in both runs alike.

The model is a random-init BERT (``--hidden``, ``--layers``) behind mean pooling, built from a
``BertConfig`` and a vocabulary written to a temporary directory; nothing is downloaded. The data are
synthetic (anchor, positive[, negative...]) sentences over that vocabulary: an anchor is a random set
of words, its positive the same words shuffled with a few replaced, a hard negative shares half of
them, so the loss can fall below log(batch).

``--loss both`` (the default) trains with each loss in a fresh process, from the same initial
weights, data order and seed, and prints both runs' per-step losses (with dropout on: infcl's cached
loss draws the same dropout masks) and peak memory:

* loss stage: the memory that ``calculate_loss`` (the whole-batch loss and its backward to the
  embeddings, where the two losses differ) adds above what the process held when it started;
* training step: the same for a whole optimizer step (both GradCache passes over the model, the loss,
  the optimizer), above the memory held with the batch already collated.

On CPU these are resident-set high-water marks (``ru_maxrss``, reset before each measurement through
/proc/self/clear_refs); on CUDA ``torch.cuda.max_memory_allocated``. ``--loss infcl`` or
``--loss sentence-transformers`` trains with one loss in this process (also under torchrun, where
``--gather`` sets ``gather_across_devices=True``). Needs ``datasets`` and ``accelerate``
(``pip install "sentence-transformers[train]"``).
"""

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

import torch

LOSSES = ("sentence-transformers", "infcl")
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MIB = 2**20
RU_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
CLEAR_REFS = "/proc/self/clear_refs"  # writing "5" resets the RSS high-water mark (Linux)
RESULT_PREFIX = "RESULT "


# ---- memory -------------------------------------------------------------------------------------


class PeakMemory:
    """Peak memory of a stretch of code above the memory held when it started (CPU RSS or CUDA)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peak_bytes = 0
        self._base = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return
        libc = ctypes.util.find_library("c")
        if libc is not None and sys.platform.startswith("linux"):
            ctypes.CDLL(libc).malloc_trim(0)  # hand freed heap back, so the base is what is in use
        try:
            with open("/proc/self/statm") as f:
                self._base = int(f.read().split()[1]) * resource.getpagesize()
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:  # no /proc: the growth of the process's high-water mark, a lower bound
            self._base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_UNIT

    def stop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_UNIT
        self.peak_bytes = max(self.peak_bytes, peak - self._base)


def measure_calls(obj, method: str, meter: PeakMemory) -> None:
    """Make ``obj.method`` run inside ``meter`` (an instance attribute shadowing the method)."""
    real = getattr(obj, method)

    def measured(*args, **kwargs):
        meter.start()
        try:
            return real(*args, **kwargs)
        finally:
            meter.stop()

    setattr(obj, method, measured)


# ---- model and data -----------------------------------------------------------------------------


def build_model(args):
    """A random-init BERT SentenceTransformer over the words ``w0 .. w{vocab-1}`` (mean pooling)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizer

    with tempfile.TemporaryDirectory() as path:
        vocab = os.path.join(path, "vocab.txt")
        with open(vocab, "w") as f:
            f.write("\n".join(SPECIAL_TOKENS + tuple(f"w{i}" for i in range(args.vocab))) + "\n")
        config = BertConfig(
            vocab_size=len(SPECIAL_TOKENS) + args.vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=max(1, args.hidden // 32),
            intermediate_size=4 * args.hidden,
            max_position_embeddings=64,
        )
        torch.manual_seed(args.seed)
        BertModel(config).save_pretrained(path)
        BertTokenizer(vocab=vocab).save_pretrained(path)
        transformer = Transformer(path)
    return SentenceTransformer(modules=[transformer, Pooling(args.hidden, "mean")])


def build_dataset(args):
    """(anchor, positive, negative_1..n) columns of ``batch_size * steps`` synthetic sentences."""
    from datasets import Dataset

    rng = random.Random(args.seed)
    words = [f"w{i}" for i in range(args.vocab)]
    columns = {"anchor": [], "positive": [], **{f"negative_{j + 1}": [] for j in range(args.negatives)}}
    for _ in range(args.batch_size * args.steps):
        anchor = rng.sample(words, args.words)
        positive = anchor[:]
        for i in rng.sample(range(args.words), args.words // 3):
            positive[i] = rng.choice(words)
        rng.shuffle(positive)
        columns["anchor"].append(" ".join(anchor))
        columns["positive"].append(" ".join(positive))
        for j in range(args.negatives):
            shared = rng.sample(anchor, args.words // 2)
            columns[f"negative_{j + 1}"].append(" ".join(shared + rng.sample(words, args.words - len(shared))))
    return Dataset.from_dict(columns)


# ---- one training run ---------------------------------------------------------------------------


def make_loss(name, model, args):
    if name == "infcl":
        from infcl.sentence_transformers import CachedMultipleNegativesRankingLoss

        extra = {"backend": args.backend}
    else:
        from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

        extra = {}
    return CachedMultipleNegativesRankingLoss(
        model, scale=args.scale, mini_batch_size=args.mini_batch_size, gather_across_devices=args.gather, **extra
    )


def train(name, args):
    """Train with one loss; return its per-step losses, peak memory (MiB) and time."""
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    model = build_model(args)
    dataset = build_dataset(args)
    loss = make_loss(name, model, args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loss_stage, step = PeakMemory(device), PeakMemory(device)
    measure_calls(loss, "calculate_loss", loss_stage)

    class StepMemory(TrainerCallback):
        def on_step_begin(self, *_, **__):
            step.start()

        def on_step_end(self, *_, **__):
            step.stop()

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as out_dir:
        training_args = SentenceTransformerTrainingArguments(
            output_dir=out_dir,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.lr,
            warmup_steps=0,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=args.seed,
            dataloader_drop_last=True,
            use_cpu=device.type == "cpu",  # also makes accelerate see a torchrun CPU group as distributed
        )
        trainer = SentenceTransformerTrainer(
            model=model, args=training_args, train_dataset=dataset, loss=loss, callbacks=[StepMemory()]
        )
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.train()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    return {
        "loss": name,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "loss_stage_mib": loss_stage.peak_bytes / MIB,
        "step_mib": step.peak_bytes / MIB,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "device": str(device),
    }


# ---- main ---------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loss", choices=("both",) + LOSSES, default="both")
    parser.add_argument("--batch-size", type=int, default=4096, help="per-device batch")
    parser.add_argument("--mini-batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--negatives", type=int, default=1, help="hard-negative columns")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--words", type=int, default=8, help="words per sentence")
    parser.add_argument("--scale", type=float, default=20.0)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="cal_inf_loss backend for infcl's loss")
    parser.add_argument("--gather", action="store_true", help="gather_across_devices=True (under torchrun)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return parser.parse_args(argv)


def run_in_fresh_process(name, argv):
    """This script with ``--loss name`` in a new process (so its peak memory is its own)."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv, "--loss", name], check=True, capture_output=True, text=True
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def report(results, args):
    ranks = int(os.environ.get("WORLD_SIZE", "1")) if args.gather else 1  # whose documents each anchor sees
    print(
        f"per-device batch {args.batch_size}, mini-batches of {args.mini_batch_size}, {args.negatives} hard negative "
        f"column(s), {args.steps} steps, BERT hidden {args.hidden} x {args.layers} layers, on {results[0]['device']}"
        f"{f', gathered across {ranks} ranks' if args.gather else ''}; "
        f"log(candidates) = {math.log(ranks * args.batch_size * (1 + args.negatives)):.3f}"
    )
    print(f"{'loss':<24}{'loss per step':<44}{'loss stage peak':>17}{'training step peak':>20}{'time (CPU)':>16}")
    for r in results:
        steps = " ".join(f"{x:.4f}" for x in r["losses"])
        print(
            f"{r['loss']:<24}{steps:<44}{r['loss_stage_mib']:>13.1f} MiB{r['step_mib']:>16.1f} MiB"
            f"{r['seconds']:>8.1f}s ({r['cpu_seconds']:.1f}s)"
        )
    if len(results) == 2:
        gap = max(abs(a - b) for a, b in zip(results[0]["losses"], results[1]["losses"]))
        print(f"largest per-step loss difference: {gap:.2e}")


def main():
    try:
        import accelerate  # noqa: F401
        import datasets  # noqa: F401
    except ImportError as error:
        sys.exit(f"{error.name} is missing: SentenceTransformerTrainer needs 'sentence-transformers[train]'")
    args = parse_args()
    if args.loss == "both":
        report([run_in_fresh_process(name, sys.argv[1:]) for name in LOSSES], args)
        return
    result = train(args.loss, args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(RESULT_PREFIX + json.dumps(result))
        report([result], args)


if __name__ == "__main__":
    main()
