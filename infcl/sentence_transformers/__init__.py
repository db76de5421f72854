"""sentence-transformers' contrastive losses backed by infcl: switch by changing one import.

    # from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    from infcl.sentence_transformers import CachedMultipleNegativesRankingLoss

    loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=64)   # same arguments
    trainer = SentenceTransformerTrainer(model=model, train_dataset=dataset, loss=loss)

The six classes ((Cached)MultipleNegatives(Symmetric)RankingLoss, (Cached)GISTEmbedLoss) take
sentence-transformers 6.x's constructor arguments, every option included (plus keyword-only ``group``
and ``backend``), and give the same loss and parameter gradients; the loss itself is ``cal_inf_loss``
(never a B x B similarity matrix), ``gather_across_devices`` runs over infcl's ring (no rank holds
gathered embeddings), and the cached ranking losses run infcl's GradCache phases. How each option
maps onto ``cal_inf_loss``: :mod:`infcl.sentence_transformers.objective`. ``mine_hard_negatives`` is
``sentence_transformers.util.mine_hard_negatives`` with the exact ``infcl.topk_scores`` search
(:mod:`infcl.sentence_transformers.mining`). The multi-vector (late-interaction) losses
(Cached)MultiVectorMultipleNegativesRankingLoss run on ``infcl.cal_maxsim_loss``
(:mod:`infcl.sentence_transformers.multi_vector`). Importing this module
imports sentence-transformers (6.x); ``import infcl`` does not.
"""

import sentence_transformers

_MAJOR = int(sentence_transformers.__version__.split(".")[0])
if _MAJOR < 6:
    raise ImportError(
        f"infcl.sentence_transformers needs sentence-transformers >= 6 (found {sentence_transformers.__version__}): "
        "it subclasses the 6.x loss classes"
    )

from .cached import CachedMultipleNegativesRankingLoss, CachedMultipleNegativesSymmetricRankingLoss  # noqa: E402
from .gist import CachedGISTEmbedLoss, GISTEmbedLoss  # noqa: E402
from .losses import MultipleNegativesRankingLoss, MultipleNegativesSymmetricRankingLoss  # noqa: E402
from .matryoshka import MatryoshkaLoss  # noqa: E402
from .mining import mine_hard_negatives  # noqa: E402
from .multi_vector import (  # noqa: E402
    CachedMultiVectorMultipleNegativesRankingLoss,
    MultiVectorMultipleNegativesRankingLoss,
)

__all__ = [
    "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "GISTEmbedLoss",
    "CachedGISTEmbedLoss",
    "MatryoshkaLoss",
    "mine_hard_negatives",
    "MultiVectorMultipleNegativesRankingLoss",
    "CachedMultiVectorMultipleNegativesRankingLoss",
]
