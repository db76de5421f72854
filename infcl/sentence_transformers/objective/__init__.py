"""sentence-transformers' MultipleNegativesRankingLoss and GISTEmbedLoss objectives, computed by ``cal_inf_loss``.

:func:`ranking_loss` (every direction, partition and hardness option; :mod:`.ranking`) and :func:`gist_loss`
(:mod:`.gist`) take embeddings and give the local mean loss, O(B·D) memory: nothing B x B is built. Beside
them: the features they hand ``cal_inf_loss`` (:mod:`.features`), the process group it rings over
(:mod:`.groups`), and sentence-transformers' options as the objectives take them (:mod:`.options`). The
math, and why each setting maps onto the call it does: docs/integrations.md, "How the objectives map onto
cal_inf_loss".
"""

from .features import COSINE, DOT
from .gist import MIN_GUIDE_POSITIVE, gist_loss
from .groups import loss_group
from .options import (
    OBJECTIVE_ARGUMENTS,
    SUPPORTED_SIMILARITIES,
    SYMMETRIC_SETTINGS,
    call_options,
    check_group,
    check_supported,
    keep_options,
    objective_arguments,
    similarity_kind,
)
from .ranking import (
    DIRECTIONS,
    DOC_SEGMENT,
    DOC_TO_DOC,
    DOC_TO_QUERY,
    DOCS,
    EXCLUDE_OWN,
    HARDNESS_MODES,
    IN_BATCH_HARDNESS,
    KEEP_OWN,
    OWN_NEGATIVE_HARDNESS,
    OWN_NEGATIVES_APART,
    PENALTY_SEGMENT,
    QUERIES,
    QUERY_SEGMENT,
    QUERY_TO_DOC,
    QUERY_TO_QUERY,
    Direction,
    ranking_loss,
)

__all__ = [
    "COSINE",
    "DIRECTIONS",
    "DOCS",
    "DOC_SEGMENT",
    "DOC_TO_DOC",
    "DOC_TO_QUERY",
    "DOT",
    "Direction",
    "EXCLUDE_OWN",
    "HARDNESS_MODES",
    "IN_BATCH_HARDNESS",
    "KEEP_OWN",
    "MIN_GUIDE_POSITIVE",
    "OBJECTIVE_ARGUMENTS",
    "OWN_NEGATIVES_APART",
    "OWN_NEGATIVE_HARDNESS",
    "PENALTY_SEGMENT",
    "QUERIES",
    "QUERY_SEGMENT",
    "QUERY_TO_DOC",
    "QUERY_TO_QUERY",
    "SUPPORTED_SIMILARITIES",
    "SYMMETRIC_SETTINGS",
    "call_options",
    "check_group",
    "check_supported",
    "gist_loss",
    "keep_options",
    "loss_group",
    "objective_arguments",
    "ranking_loss",
    "similarity_kind",
]
