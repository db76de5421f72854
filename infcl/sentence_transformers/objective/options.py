"""sentence-transformers' options as the objectives take them: the similarity function's kind, the checks of
what the objectives compute, and the arguments the loss classes keep or hand on."""

from typing import Any, Dict, Mapping

from sentence_transformers import util
from sentence_transformers.util.similarity import SimilarityFunction

from .features import COSINE, DOT
from .groups import loss_group
from .ranking import DOC_TO_QUERY, QUERY_TO_DOC

SUPPORTED_SIMILARITIES = (
    "sentence_transformers.util.cos_sim, util.dot_score, or model.similarity with similarity_fn_name 'cosine' or 'dot'"
)


def similarity_kind(similarity_fct) -> str:
    """ "cosine" or "dot" for the similarity functions the loss maps onto; ValueError otherwise."""
    owner = getattr(similarity_fct, "__self__", None)
    if getattr(similarity_fct, "__name__", None) == "similarity" and hasattr(owner, "similarity_fn_name"):
        # model.similarity dispatches on the model's similarity_fn_name at call time: resolve it now.
        similarity_fct = SimilarityFunction.to_similarity_fn(owner.similarity_fn_name)
    if similarity_fct is util.cos_sim or similarity_fct is util.pytorch_cos_sim:  # the latter calls the former
        return COSINE
    if similarity_fct is util.dot_score:
        return DOT
    raise ValueError(
        f"similarity_fct={util.similarity_fct_name(similarity_fct)} is not supported by infcl's losses; "
        f"supported: {SUPPORTED_SIMILARITIES} (or use sentence-transformers' own loss)"
    )


def check_supported(loss, group=None) -> None:
    """ValueError when ``loss``'s settings ask for something ``ranking_loss`` does not compute (the
    directions, partition and hardness options are sentence-transformers' to check)."""
    similarity_kind(loss.similarity_fct)
    check_group(loss.gather_across_devices, group)


def check_group(gather_across_devices: bool, group) -> None:
    if group is not None and not gather_across_devices:
        raise ValueError("group is the process group to gather across: it needs gather_across_devices=True")


# The arguments of sentence-transformers' MultipleNegativesRankingLoss that define the objective: what the
# other classes' constructors hand on to it.
OBJECTIVE_ARGUMENTS = (
    "scale",
    "similarity_fct",
    "gather_across_devices",
    "directions",
    "partition_mode",
    "hardness_mode",
    "hardness_strength",
)
# What the deprecated symmetric classes fix: both directions, one log-sum-exp each.
SYMMETRIC_SETTINGS = {"directions": (QUERY_TO_DOC, DOC_TO_QUERY), "partition_mode": "per_direction"}


def keep_options(loss, group, backend) -> None:
    """Check and keep infcl's keyword-only constructor arguments on ``loss`` (after sentence-transformers'
    constructor, which sets ``gather_across_devices``)."""
    check_group(loss.gather_across_devices, group)
    loss.group, loss.backend = group, backend


def objective_arguments(arguments: Mapping[str, Any]) -> Dict[str, Any]:
    """The :data:`OBJECTIVE_ARGUMENTS` among ``arguments`` (a constructor's arguments by name), to hand on by
    keyword: one forwarding for every class, whatever subset of the objective its signature mirrors."""
    return {name: arguments[name] for name in OBJECTIVE_ARGUMENTS if name in arguments}


def call_options(loss) -> Dict[str, Any]:
    """The ``group`` and ``backend`` a loss class hands its objective: the process group to ring over
    (:func:`~.groups.loss_group` of its ``gather_across_devices`` and ``group``) and its backend."""
    return {"group": loss_group(loss.gather_across_devices, loss.group), "backend": loss.backend}
