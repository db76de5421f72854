"""A tiny offline SentenceTransformer and batches for it, shared by the sentence-transformers tests
and their distributed worker (import only where sentence-transformers is installed).

The model is a random-init BERT (one layer, hidden 16) behind mean pooling, built from a
``BertConfig`` and a vocabulary file written to a temporary directory: nothing is downloaded. Build
it before ``torch.distributed`` is initialized: under a process group transformers writes the
files on rank 0 only.
"""

import os
import random
import tempfile

import torch

WORDS = tuple(f"w{i}" for i in range(40))
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
HIDDEN = 16
MAX_WORDS = 9  # words per sentence: uneven lengths, so batches are padded and mini-batches trimmed


def tiny_model(seed: int = 0, dropout: float = 0.1):
    """A random-init BERT SentenceTransformer (mean pooling) on the CPU, the same for the same seed."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizer

    with tempfile.TemporaryDirectory() as path:
        vocab = os.path.join(path, "vocab.txt")
        with open(vocab, "w") as f:
            f.write("\n".join(SPECIAL + WORDS) + "\n")
        config = BertConfig(
            vocab_size=len(SPECIAL) + len(WORDS),
            hidden_size=HIDDEN,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
        torch.manual_seed(seed)
        BertModel(config).save_pretrained(path)
        BertTokenizer(vocab=vocab).save_pretrained(path)
        transformer = Transformer(path)
    return SentenceTransformer(modules=[transformer, Pooling(HIDDEN, "mean")], device="cpu")


def sentences(batch_size: int, columns: int, seed: int):
    """``columns`` lists (anchor, positive, negatives...) of ``batch_size`` random sentences."""
    rng = random.Random(seed)
    return [
        [" ".join(rng.choices(WORDS, k=rng.randint(1, MAX_WORDS))) for _ in range(batch_size)] for _ in range(columns)
    ]


def features(model, texts):
    """One feature dict per column of sentences."""
    return [dict(model.preprocess(column)) for column in texts]


def batch(model, batch_size: int, columns: int, seed: int):
    """``columns`` feature dicts (anchor, positive, negatives...) of ``batch_size`` random sentences."""
    return features(model, sentences(batch_size, columns, seed))


def loss_and_grads(loss_fn, model, features):
    """(loss, {name: grad}) of one forward/backward; the features are copied (the model writes into them)."""
    model.zero_grad(set_to_none=True)
    loss = loss_fn([dict(f) for f in features], None)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads
