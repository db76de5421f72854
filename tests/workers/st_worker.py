"""One rank of tests/test_sentence_transformers.py's gather_across_devices test (through tests/helpers/distributed.py).

Every rank builds the same tiny model and its own batch, then runs sentence-transformers' loss and
infcl's on it for each case in ``CASES``: (loss, parameter gradients) of both go back to the parent,
which compares them rank by rank. ``UNEVEN`` runs infcl's loss with a different batch size on each
rank (sentence-transformers' all_gather cannot) against their single-process loss of the whole batch.
"""

import warnings

import torch
from torch.nn.parallel import DistributedDataParallel

from helpers.distributed import finish, init_worker
from helpers.st_models import batch, features, loss_and_grads, sentences, tiny_model

RANK_BATCH = 5
GTE = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
GUIDE = "guide"  # stands for the guide model (built in main)
GUIDE_SEED = 7
# name -> (class name, constructor arguments, columns, wrap the model in DDP)
CASES = {
    "mnrl-pairs-cos": ("MultipleNegativesRankingLoss", {}, 2, False),
    "mnrl-2neg-dot": ("MultipleNegativesRankingLoss", {"similarity_fct": "dot_score", "scale": 1.0}, 4, False),
    "mnrl-joint-1neg": ("MultipleNegativesRankingLoss", {"directions": ("query_to_doc", "doc_to_query")}, 3, False),
    "mnrl-local-1neg": ("MultipleNegativesRankingLoss", {"gather_across_devices": False}, 3, False),
    "cached-1neg": ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2}, 3, False),
    "cached-sym-pairs": ("CachedMultipleNegativesSymmetricRankingLoss", {"mini_batch_size": 2}, 2, False),
    "cached-perdir-2neg": (
        "CachedMultipleNegativesRankingLoss",
        {"mini_batch_size": 3, "directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"},
        4,
        False,
    ),
    # Issue 24: same-type directions and hardness (ids and a guide mask travelling with the keys), GIST
    # (the guide mask; the anchor-anchor columns stay each rank's own).
    "mnrl-gte-1neg": ("MultipleNegativesRankingLoss", {"directions": GTE}, 3, False),
    "mnrl-gte-inbatch-1neg": (
        "MultipleNegativesRankingLoss",
        {"directions": GTE, "hardness_mode": "in_batch_negatives", "hardness_strength": 9.0},
        3,
        False,
    ),
    "cached-gte-hard-2neg": (
        "CachedMultipleNegativesRankingLoss",
        {"mini_batch_size": 2, "directions": GTE, "hardness_mode": "hard_negatives", "hardness_strength": 5.0},
        4,
        False,
    ),
    "mnrl-perdir-all-1neg": (
        "MultipleNegativesRankingLoss",
        {
            "directions": ("query_to_doc", "doc_to_query"),
            "partition_mode": "per_direction",
            "hardness_mode": "all_negatives",
            "hardness_strength": 3.0,
        },
        3,
        False,
    ),
    "gist-1neg": ("GISTEmbedLoss", {"guide": GUIDE, "margin": 0.01}, 3, False),
    "cached-gist-relative-pairs": (
        "CachedGISTEmbedLoss",
        {"guide": GUIDE, "mini_batch_size": 2, "margin_strategy": "relative", "margin": 0.01},
        2,
        False,
    ),
    "cached-ddp-1neg": ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2}, 3, True),
}
UNEVEN_BATCHES = (5, 3)  # per rank
UNEVEN_COLUMNS = 4
UNEVEN_PADDED = {"directions": GTE, "hardness_mode": "all_negatives", "hardness_strength": 3.0}


def _make(module, name, model, kwargs, ddp, guide=None):
    from sentence_transformers import util

    kwargs = dict(kwargs)
    if kwargs.get("guide") == GUIDE:
        kwargs["guide"] = guide
    kwargs.setdefault("gather_across_devices", True)
    if "similarity_fct" in kwargs:
        kwargs["similarity_fct"] = getattr(util, kwargs["similarity_fct"])
    if module.__name__.startswith("infcl"):
        kwargs["backend"] = "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the symmetric classes are deprecated
        loss = getattr(module, name)(model, **kwargs)
    if ddp:  # what SentenceTransformerTrainer does: the wrapped model replaces loss.model
        loss.model = ddp
        loss.loss.model = ddp
    return loss


def main():
    from sentence_transformers.sentence_transformer import losses as st_losses

    import infcl.sentence_transformers as infcl_losses

    model = tiny_model()  # before the process group: under one, transformers saves files on rank 0 only
    model.eval()
    guide = tiny_model(seed=GUIDE_SEED)
    guide.eval()
    rank, world = init_worker()
    results = {}
    # Uneven shards: every rank can rebuild every rank's sentences, so each computes the whole batch's loss.
    texts = [sentences(size, UNEVEN_COLUMNS, seed=20 + r) for r, size in enumerate(UNEVEN_BATCHES)]
    whole = [sum((shard[c] for shard in texts), []) for c in range(UNEVEN_COLUMNS)]
    ours = _make(infcl_losses, "MultipleNegativesRankingLoss", model, {}, None)
    theirs = _make(st_losses, "MultipleNegativesRankingLoss", model, {"gather_across_devices": False}, None)
    with torch.no_grad():
        results["uneven"] = (ours(features(model, texts[rank]), None), theirs(features(model, whole), None))
    # The same with the ids and the copy guide of the padded call (global ids from uneven row offsets).
    ours = _make(infcl_losses, "MultipleNegativesRankingLoss", model, UNEVEN_PADDED, None)
    theirs = _make(
        st_losses, "MultipleNegativesRankingLoss", model, dict(UNEVEN_PADDED, gather_across_devices=False), None
    )
    with torch.no_grad():
        results["uneven-padded"] = (ours(features(model, texts[rank]), None), theirs(features(model, whole), None))

    ddp = None
    for case, (name, kwargs, columns, wrap) in CASES.items():  # the DDP cases last: DDP hooks the parameters
        if wrap and ddp is None:
            ddp = DistributedDataParallel(model, find_unused_parameters=True)  # BERT's pooler is unused
        feats = batch(model, RANK_BATCH, columns, seed=10 + rank)
        results[case] = tuple(
            loss_and_grads(_make(module, name, model, kwargs, ddp if wrap else None, guide), model, feats)
            for module in (st_losses, infcl_losses)
        )
    finish(results)


if __name__ == "__main__":
    main()
