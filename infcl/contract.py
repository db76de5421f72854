"""The block contract: what a backend computes on one (local q rows) x (k block) pair, for every API.

The ground floor of the package (it imports only torch): the ring driver, the losses' steps and every
backend (:mod:`infcl.backends`: ``torch_tiles/``, ``native/``, ``triton/``, a file per loss) meet here.
One backend object per backend implements the block operations of the five APIs below (softmax,
sigmoid, distillation, retrieval ranks, top-k search); each returns packed rows, which the loss layer
(:mod:`infcl.losses`) unpacks into its named tensors (the top-k search continues its rows' lists in place).

The ring driver (:mod:`infcl.ring.driver`) owns the loop over k blocks and the reductions; a backend
turns one block S = scale * q @ k.T into statistics (forward) and gradient contributions (backward)
without ever holding S whole. Everything a block operation reads travels in one frozen
:class:`Block`, so a new loss or option adds a field, not a parameter in every backend. All outputs are
in the accumulation dtype (float32 for float32/bfloat16/float16 inputs, float64 for float64).

The positives are part of the block: ``Block.pos[i]`` is the column *within this block* of row i's
positive, or -1 when it lies in another block. Backends read the positive logit off the same tile
arithmetic as the log-sum-exp and subtract the one-hot inside the tile, so nothing outside the tiles
recomputes a dot product with different rounding.

Softmax (InfoNCE / CLIP) loss — stats are ``[2, n]`` (max, log-sum relative to it; see :mod:`infcl.lse`):

``forward_block(block, symmetric) -> (rows [3, Bq], cols [2, Bk] or None)``
    rows[0:2] = stats of each row of S over this block's columns
    rows[2]   = S[i, pos[i]] where pos[i] >= 0, else 0 (the positive logit, from the same tile)
    cols      = stats of each column over the local rows (only for the ``symmetric`` loss)

``backward_block(block, dq, dk) -> dscale [2]`` with the *global* stats and upstream gradients in the
block (``row_stats``, ``g_row`` and, symmetric, ``col_stats``, ``g_col``); Y is the one-hot of ``pos``:
    P_row   = exp((S - m_row) - r_row),  P_col likewise with the column stats
    dS      = g_row * (P_row - Y) + g_col * (P_col - Y)    formed in the accumulation dtype, in the tile
    dq     += scale * dS @ k                                accumulated in place, [Bq, D]
    dk     += scale * dS.T @ q                              accumulated in place, [Bk, D]
    dscale  = (sum(g_row * (P_row - Y) * q @ k.T), sum(g_col * (P_col - Y) * q @ k.T))
The scale gradient is a sum of per-entry terms (never a difference of two large sums), split by
direction so the ring can credit each rank's replica of the scale with the derivative of its own loss
(open_clip's convention). The backward must recompute S bit-identically to its forward.

Masks (:mod:`infcl.masks`; ``Block.masks``, one :class:`MaskOptions`) — the block also carries the ids of
its rows and columns (``q_ids`` [Bq], ``k_ids`` [Bk], int64), the guide features (``guide_q`` [Bq, D'],
``guide_k`` [Bk, D'], in the guide's accumulation dtype) with each row's (and, symmetric, column's)
threshold, and ``multi_positive``, all fields of ``block.masks``. Inside each tile, never beyond it: the
positives P (the one-hot of ``pos`` when ``multi_positive`` is None, else ``q_ids[i] == k_ids[j]``) and
the exclusions E = (same id or guide score G = guide_q @ guide_k.T above the threshold) and not P; the
column direction's E uses the column thresholds. The forward's outputs are then ``[6, n]`` for rows and
columns alike (rows of :mod:`infcl.masks`): the stats over the columns not in E, the positives' max (and,
for "sum", their log-sum relative to it), the sum of the positives' logits and their count. The backward forms, with
P_row = exp((S - m) - r) off E and 0 on E, and the positives' global count (``row_pos_count``, "mean")
or stats (``row_pos_stats``, "sum"):
    Y = the one-hot of ``pos`` (multi_positive None): as above, the positive's entry g * expm1(x)
    Y = 1 / |P(i)| on P ("mean"): the entry p - 1/c as expm1(x + log c) / c
    Y = softmax of S over P(i) ("sum"): the entry p - y as y * expm1(d), d = lse(P(i)) - lse_i <= 0
and dq, dk, dscale as above. The thresholds come from a pass before the loss:
``guide_label_scores(guide_q, guide_k, pos, feature_dtype) -> [Bq]`` G[i, pos[i]] (0 where pos[i] < 0),
by the same arithmetic as the guide scores of the backend's tiles for features of ``feature_dtype``,
so a column that duplicates the labelled one ties its threshold exactly. With ids that never repeat
(nothing excluded, one positive per row) every one of these is the plain loss bit for bit.

Label smoothing over the kept entries (a backend whose ``kept_sums`` attribute is True;
:mod:`infcl.losses.smoothing`): with ``Block.kept_sums`` the masked forward's rows and columns are ``[8, n]``,
rows 6 and 7 (:data:`infcl.masks.KEPT_SUM`, ``KEPT_COUNT``) the sum of the line's logits over the entries not
in E and their number, from the tile's own E;
the masked backward subtracts ``row_uniform[i]`` (and ``col_uniform[j]``) from dS on every entry not in the
row's (column's) E, so dq, dk and dscale take it as they take the rest of dS.

Sigmoid (SigLIP) loss — ``Block.bias`` is set, logits are L = scale * q @ k.T + bias and z = +1 at the
positive (Y = one-hot of ``pos``; with ``Block.masks``, its ids: wherever ``q_ids[i] == k_ids[j]``, ``pos``
unread), -1 elsewhere; nothing is merged across blocks but plain sums:

``sigmoid_forward_block(block) -> rows [Bq]``
    rows[i] = sum_j softplus(-z_ij * L_ij)    (= -log sigmoid(z_ij * L_ij), never formed as log(sigmoid))

``sigmoid_backward_block(block, dq, dk) -> dparams [2]`` with the upstream gradients ``g_row``:
    dL      = g_row * (sigmoid(L) - Y)     formed as g * sigmoid(L) off the positive, -g * sigmoid(-L) on it
    dq     += scale * dL @ k,   dk += scale * dL.T @ q
    dparams = (sum(dL * q @ k.T), sum(dL))     the scale and the bias gradient

Distillation (open_clip's ``DistillClipLoss`` term; math: :mod:`infcl.losses.distill`) — the teacher's side of
the block is a :class:`Teacher` (its features of the block's rows and columns, its scale):

``distill_forward_block(block, teacher, symmetric) -> (rows [5, Bq], cols [5, Bk] or None)``
    rows[0:2] = the student's stats of each row of S over this block's columns, rows[2:4] the teacher's of T,
    rows[4] = sum_j exp(T_ij - mT_i) * (m_i - S_ij) over them (:data:`DISTILL_ROWS`); cols likewise per column

``distill_backward_block(block, teacher, dq, dk) -> dscale [2]`` with the *global* stats ``row_stats`` [4, Bq]
(the student's then the teacher's, rows 0:4 of the forward's), ``g_row`` and, symmetric, ``col_stats``, ``g_col``:
    dS = g_row * (softmax_row(S) - softmax_row(T)) + g_col * (softmax_col(S) - softmax_col(T)), dq, dk and
    dscale (the rows' term, the columns' term) as for the softmax loss

Retrieval ranks (:func:`infcl.metrics.retrieval_metrics`; no scale: ranks of q @ k.T), two passes, with
``row_index`` / ``col_index`` the global indices of the block's rows and columns:

``best_positives(block, row_index, col_index, symmetric) -> (rows, cols or None)``, each a :class:`Best`:
    the best positive's score and global index (the lowest index among equal scores) and the number of
    positives, over this block, per row (and, ``symmetric``, per column). The positives: the one-hot of
    ``block.pos`` (and, for the columns, the rows whose positive is that column), or, with
    ``block.masks.multi_positive`` ("any"), every entry with ``q_ids[i] == k_ids[j]``.

``ahead_counts(block, rows, cols, row_index, col_index) -> (rows, cols or None)``, each an :class:`Ahead`:
    per row (column), the columns (rows) of the block ahead of its best positive (``rows`` / ``cols``: the
    global :class:`Best` thresholds: scoring strictly higher, or equal with a lower global index), leaving out
    the entries with the row's id when ids are given without ``multi_positive``, and how many of its scores
    are not finite. The threshold and every score compared with it come from the same tile product.

MaxSim contrastive loss (:func:`infcl.cal_maxsim_loss`; late interaction) — ``Block.q`` is ``[Bq, Lq, D]`` token
embeddings, ``Block.k`` ``[Bk, Lk, D]``, with ``q_weight`` ``[Bq, Lq]`` (a query token's weight: 0 for a masked token,
1 or 1 / the query's real token count) and ``k_mask`` ``[Bk, Lk]`` (bool, the real document tokens; None: all). The
scores are S = scale * R with R[i, j] = sum_t w[i, t] * max_{u real} q[i, t] . k[j, u] (a document with no real token:
R = -inf where the query has a weighted token, 0 elsewhere); a masked document token never wins a max, and among
equal maxima the lowest u does. The softmax over S is the plain softmax loss's, one direction, with ``pos`` and the
ids' false negatives (``masks``, a :class:`MaskOptions` with ids only: a column with the row's id that is
not its positive is left out):

``maxsim_forward_block(block) -> rows [3, Bq]``: as ``forward_block``'s rows (stats over the block, positive score)

``maxsim_backward_block(block, dq, dk) -> dscale [2]`` with ``row_stats`` and ``g_row``: dS = g * (P - Y) on the
S tile as for the softmax loss, each entry routed to the maximal token pair that formed it: with
C[i, t, j] = scale * dS[i, j] * w[i, t] and u*(i, t, j) the winning document token, the sparse P over the token tile
(P[(i, t), (j, u*)] = C) gives ``dq += P @ k`` and ``dk += P.T @ q`` (products in a fixed order, no atomics);
``dscale = (sum dS * R, 0)`` (the second term, a column direction's, is always 0).

Top-k search (:func:`infcl.topk_scores`; no scale: the top-k of q @ k.T), one pass, with ``col_index`` the
global indices of the block's columns (increasing):

``block_topk(block, col_index, found, largest, exclude_positive) -> None``
    continues ``found`` (:class:`Candidates` [Bq, n]: each row's n best so far) in place with the block's
    eligible columns: each row leaves with its n best by (key desc, global index asc), where the key is the
    score (``largest``) or its negation (exact: the order reversed, ties kept), best first, and with the NaN
    scores among its eligible columns added to ``found.nan``. Eligible: every column, less the row's positive
    (``block.pos``, where ``exclude_positive``) and the columns with the row's id (``block.masks``'
    ``q_ids`` / ``k_ids``). Slots past the eligible columns hold (-inf, :data:`NO_INDEX`). The order is strict
    (global indices are unique), so the n best of a union are the n best of its parts' n best: the lists
    depend on the scores alone, never on the tiles, the thread count or the world size.
"""

from dataclasses import dataclass, replace
from typing import ClassVar, NamedTuple, Optional, Protocol, Tuple

import torch

Tensor = torch.Tensor


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float dtype accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class MaskOptions:
    """One call's mask options (:mod:`infcl.masks`): which columns are a row's positives and which are left
    out of its softmax. One value from the API (:func:`infcl.checks.make_masks`) through the losses, the
    ring and every backend (``Block.masks``) to the launch, which flattens it (the native op call, the
    Triton custom ops' schemas). None fields are unused.

    The k side (:data:`K_SIDE`: the columns' ids, guide features and thresholds) travels with its k block
    around the ring: :meth:`k_side` gives the tensors to send, :meth:`holding` the options of the block
    held at a step. The guide thresholds are set once, by the pass before the loss (:mod:`infcl.function`).
    """

    q_ids: Optional[Tensor] = None  # [Bq] int64 ids of the rows, on q's device
    k_ids: Optional[Tensor] = None  # [Bk] int64 ids of the columns (in a Block: the held block's)
    # Which columns are positives: None (softmax: ``pos``; the ids' matches are false negatives), "mean" |
    # "sum" (softmax: every column with the row's id), "any" (retrieval ranks: every column with the row's id).
    # The sigmoid loss with ids has every column with the row's id as a positive, whatever this field.
    multi_positive: Optional[str] = None
    guide_q: Optional[Tensor] = None  # [Bq, D'] guide features of the rows (detached; in a Block: accumulation dtype)
    guide_k: Optional[Tensor] = None  # [Bk, D'] guide features of the columns
    margin: float = 0.0  # the guide threshold's margin and strategy (infcl.masks.guide_threshold)
    strategy: str = "absolute"
    row_threshold: Optional[Tensor] = None  # [Bq]: G[i, j] above it excludes column j from row i
    col_threshold: Optional[Tensor] = None  # [Bk]: G[i, j] above it excludes row i from column j (symmetric only)

    K_SIDE: ClassVar[Tuple[str, ...]] = ("k_ids", "guide_k", "col_threshold")  # one row per k row: travel with k

    @property
    def has_guide(self) -> bool:
        return self.guide_q is not None

    @property
    def has_ids(self) -> bool:
        return self.q_ids is not None

    @property
    def loss_kind(self) -> str:
        """ "sum" (lse of the positives) or "mean" (mean of the positives' logits; one positive is its own mean)."""
        return "sum" if self.multi_positive == "sum" else "mean"

    def k_side(self) -> Tuple[Tensor, ...]:
        """The k side's tensors that are set, in :data:`K_SIDE` order: what travels with this rank's k block."""
        return tuple(t for t in (getattr(self, name) for name in self.K_SIDE) if t is not None)

    def holding(self, k_side: Tuple[Tensor, ...]) -> "MaskOptions":
        """These options with the k side of the block held at a ring step (``k_side``: that block's
        :meth:`k_side`, which the ring carried along with it)."""
        names = tuple(name for name in self.K_SIDE if getattr(self, name) is not None)
        assert len(names) == len(k_side), "k_side is another MaskOptions' (its set fields differ)"
        return replace(self, **dict(zip(names, k_side)))


@dataclass(frozen=True)
class Block:
    """The arguments of one block operation (forward fields first; backward-only fields default None)."""

    q: Tensor  # [Bq, D] this rank's rows, any strides
    k: Tensor  # [Bk, D] the k block held at this ring step, any strides
    scale: Tensor  # 0-d, accumulation dtype, on q's device (never a host value: no sync per step)
    pos: Tensor  # [Bq] int64: column in this block of each row's positive, -1 where it is elsewhere
    row_stats: Optional[Tensor] = None  # [2, Bq] global stats of each row (backward)
    g_row: Optional[Tensor] = None  # [Bq] upstream gradient of each row's loss (backward)
    col_stats: Optional[Tensor] = None  # [2, Bk] global stats of each column (symmetric backward)
    g_col: Optional[Tensor] = None  # [Bk] upstream gradient of each column's loss (symmetric backward)
    bias: Optional[Tensor] = None  # 0-d like scale: the sigmoid loss's logit bias (None for softmax)
    # Masks (see the module docstring): the rows' and the held block's ids and guide, None for the plain loss.
    masks: Optional[MaskOptions] = None
    row_pos_count: Optional[Tensor] = None  # [Bq] |P(i)|, global (masked backward, "mean")
    row_pos_stats: Optional[Tensor] = None  # [2, Bq] global stats of the row's positives (masked backward, "sum")
    col_pos_count: Optional[Tensor] = None  # [Bk] the same per column (symmetric)
    col_pos_stats: Optional[Tensor] = None  # [2, Bk]
    # Label smoothing's uniform part over the kept entries (masked blocks on a backend with ``kept_sums``; see
    # the module docstring): the forward's two more rows, the backward's weights.
    kept_sums: bool = False  # forward: also the sum and the number of each line's kept logits ([8, n] rows)
    row_uniform: Optional[Tensor] = None  # [Bq] subtracted from dS on each kept entry of the row (backward)
    col_uniform: Optional[Tensor] = None  # [Bk] the same for the column direction (symmetric backward)
    # MaxSim (late interaction; q [Bq, Lq, D], k [Bk, Lk, D]; see the module docstring), None otherwise.
    q_weight: Optional[Tensor] = None  # [Bq, Lq] accumulation dtype: each query token's weight in its score
    k_mask: Optional[Tensor] = None  # [Bk, Lk] bool: the block's real document tokens

    @property
    def symmetric(self) -> bool:
        return self.col_stats is not None

    @property
    def masked(self) -> bool:
        return self.masks is not None

    @property
    def upstream(self) -> tuple:
        """(row_stats, g_row, col_stats, g_col): the backward's global stats and upstream gradients, in the order
        every backward op takes them."""
        return self.row_stats, self.g_row, self.col_stats, self.g_col


def block_ids(block: Block) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """(q_ids, k_ids) of the block's mask options, (None, None) without: the retrieval ranks' and the top-k
    search's ops take the ids alone."""
    return (None, None) if block.masks is None else (block.masks.q_ids, block.masks.k_ids)


def any_positive(block: Block) -> bool:
    """Whether every column with the row's id is a positive (the ranks' ``any_positive``), not ``pos`` alone."""
    return block.masks is not None and bool(block.masks.multi_positive)


class BlockBackend(Protocol):
    """The softmax (InfoNCE / CLIP) loss's block operations (see the module docstring); every backend has them."""

    name: str

    def forward_block(self, block: Block, symmetric: bool) -> Tuple[Tensor, Optional[Tensor]]: ...

    def backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor: ...

    def guide_label_scores(
        self, guide_q: Tensor, guide_k: Tensor, pos: Tensor, feature_dtype: torch.dtype
    ) -> Tensor: ...


class SigmoidBlockBackend(Protocol):
    """The sigmoid (SigLIP) loss's block operations (see the module docstring); every backend has both."""

    name: str

    def sigmoid_forward_block(self, block: Block) -> Tensor: ...

    def sigmoid_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor: ...


# --- distillation ------------------------------------------------------------------------------------

# Rows of a backend's distillation forward result ([5, n]): the student's stats (infcl.lse MAX, REL), the
# teacher's, and the cross sum. The loss layer reads it as infcl.losses.distill.DistillPartials.
STUDENT, TEACHER, CROSS = slice(0, 2), slice(2, 4), 4
DISTILL_ROWS = 5


class Teacher(NamedTuple):
    """The teacher's side of one block: its row features, the held block's features and its scale."""

    q: Tensor  # [Bq, D_T] accumulation dtype
    k: Tensor  # [Bk, D_T] accumulation dtype
    scale: Tensor  # 0-d accumulation dtype


class DistillBlockBackend(Protocol):
    """The distillation loss's block operations (see the module docstring)."""

    name: str

    def distill_forward_block(
        self, block: Block, teacher: Teacher, symmetric: bool
    ) -> Tuple[Tensor, Optional[Tensor]]: ...

    def distill_backward_block(self, block: Block, teacher: Teacher, dq: Tensor, dk: Tensor) -> Tensor: ...


# --- retrieval ranks ---------------------------------------------------------------------------------

# The index of "no positive seen yet": larger than every global index, so any real one wins a tie.
NO_INDEX = torch.iinfo(torch.int64).max


class Best(NamedTuple):
    """The best positive of ``n`` rows (or columns) over a set of columns (rows)."""

    score: Tensor  # [n] accumulation dtype; -inf where none was seen
    index: Tensor  # [n] int64 global index of the best positive (lowest among equal scores); NO_INDEX if none
    count: Tensor  # [n] int64 number of positives seen

    @classmethod
    def empty(cls, n: int, dtype: torch.dtype, device: torch.device) -> "Best":
        return cls(
            torch.full((n,), float("-inf"), dtype=dtype, device=device),
            torch.full((n,), NO_INDEX, dtype=torch.int64, device=device),
            torch.zeros(n, dtype=torch.int64, device=device),
        )

    def merge_(self, part: "Best") -> None:
        """Keep the better of two bests over disjoint sets, in place: the higher score, then the lower index."""
        better = (part.score > self.score) | ((part.score == self.score) & (part.index < self.index))
        torch.where(better, part.score, self.score, out=self.score)
        torch.where(better, part.index, self.index, out=self.index)
        self.count.add_(part.count)


class Ahead(NamedTuple):
    """Pass 2's counts of ``n`` rows (or columns): plain sums, merged by addition."""

    ahead: Tensor  # [n] int64 entries ahead of the best positive
    nonfinite: Tensor  # [n] int64 the line's scores that are NaN or infinite

    @classmethod
    def empty(cls, n: int, device: torch.device) -> "Ahead":
        return cls(torch.zeros(n, dtype=torch.int64, device=device), torch.zeros(n, dtype=torch.int64, device=device))


class RankBlockBackend(Protocol):
    """The retrieval ranks' two passes (see the module docstring)."""

    name: str

    def best_positives(
        self, block: Block, row_index: Tensor, col_index: Tensor, symmetric: bool
    ) -> Tuple[Best, Optional[Best]]: ...

    def ahead_counts(
        self, block: Block, rows: Best, cols: Optional[Best], row_index: Tensor, col_index: Tensor
    ) -> Tuple[Ahead, Optional[Ahead]]: ...


# --- MaxSim (late interaction) -----------------------------------------------------------------------


class MaxSimBlockBackend(Protocol):
    """The MaxSim loss's block operations (see the module docstring)."""

    name: str

    def maxsim_forward_block(self, block: Block) -> Tensor: ...

    def maxsim_backward_block(self, block: Block, dq: Tensor, dk: Tensor) -> Tensor: ...


# --- top-k search ------------------------------------------------------------------------------------


class Candidates(NamedTuple):
    """Each row's best columns so far (:meth:`TopKBlockBackend.block_topk`): ``[Bq, n]`` lists, best first
    after each block."""

    key: Tensor  # [Bq, n] accumulation dtype: the score (largest) or minus it; -inf in an empty slot
    index: Tensor  # [Bq, n] int64 global column index; NO_INDEX in an empty slot (after every real index)
    nan: Tensor  # [Bq] int64: NaN scores among the row's eligible columns (only whether it is 0 matters)

    @classmethod
    def empty(cls, rows: int, n: int, dtype: torch.dtype, device: torch.device) -> "Candidates":
        return cls(
            torch.full((rows, n), float("-inf"), dtype=dtype, device=device),
            torch.full((rows, n), NO_INDEX, dtype=torch.int64, device=device),
            torch.zeros(rows, dtype=torch.int64, device=device),
        )


class TopKBlockBackend(Protocol):
    """The top-k search's block operation (see the module docstring)."""

    name: str

    def block_topk(
        self, block: Block, col_index: Tensor, found: Candidates, largest: bool, exclude_positive: bool
    ) -> None: ...
