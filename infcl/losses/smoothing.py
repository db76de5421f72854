"""Label smoothing (``cal_inf_loss(label_smoothing=eps)``) on the softmax loss's ring steps.

``F.cross_entropy(..., label_smoothing=eps)``'s target puts 1 - eps on the positive and eps / n on each
of the row's n classes, so a row's loss is

    loss_i = lse_i - (1 - eps) * S[i, label_i] - eps * mean_j S[i, j]
           = (1 - eps) * (m_i - S[i, label_i]) + eps * (m_i - mean_j S[i, j]) + r_i

(the second form, a sum of terms that are never negative, is how it is computed), and its gradient is
``dS = g_i * (P - (1 - eps) * Y - eps / n)``.

The uniform part is linear in S: over one block of columns, sum_j S[i, j] = scale * q_i . (sum_j k_j), one
matrix-vector product per block (and, symmetric, sum_i S[i, j] = scale * k_j . (sum_i q_i)), in the
accumulation dtype. So every backend and the ring get it from these steps, with no change to a kernel:
the forward adds the block's row (column) sums to :class:`SmoothedPartials`; the backward runs the plain
step (which forms g * (P - Y) in the tiles) and adds the rank-one and one-hot terms
g * eps * Y - g * eps / n per block: dq += scale * (w * k[pos] - u * sum_j k_j), dk[pos] += scale * w * q,
dk -= scale * sum_i u_i q_i, with w = eps * g at the positive and u = eps * g / n, and the scale's gradient
from the same terms (the rows' part is this rank's, the columns' part the block owner's). O(B * D) per
block, no O(Bq * Bk) anything.

With mask options the uniform part spreads over the columns that stay in the row's denominator (not in E,
:mod:`infcl.masks`), and the positives keep 1 - eps of their mode's target: (1 - eps) * the masked loss
+ eps * (lse - the mean logit over the kept columns), as ``F.cross_entropy`` mixes its two terms. Under
``multi_positive="sum"`` (MIL-NCE, -log of the positives' total probability) the target's positive part is
the softmax over the positives: the tiles' own g * (P - Y') with the positives' log-sum raised by
-log(1 - eps) (Y' = (1 - eps) * Y, the entry y' * expm1(d') as before); at eps = 1 it has weight 0 and "sum"
is "mean". Two ways to the kept columns' sum and number:

- :class:`SmoothedKeptSteps`, on a backend whose masked tiles sum them (``kept_sums``: the torch tiles, the
  native kernel, the Triton kernels, the chunked route, whose masked blocks are the fused kernels'): the tiles
  that decide E (the guide's scores against its threshold, the ids) sum and count what stays and subtract
  eps * g / n_kept from dS there (``Block.kept_sums``, ``row_uniform``, ``col_uniform``). Any mask options; a
  guide needs it (infcl.api.smoothing_backend runs such a call on the torch tiles elsewhere).
- :class:`SmoothedIdsSteps`, ids without a guide on a backend object without ``kept_sums``: same-id sums of
  the features per block (:class:`IdGroups`), O(B * D), no kernel change.
"""

import math
from dataclasses import replace
from typing import NamedTuple, Optional, Tuple

import torch

from ..contract import Block, BlockBackend, MaskOptions, Tensor
from ..lse import MAX, REL, lse_merge
from ..masks import KEPT_COUNT, KEPT_SUM, merge_masked_fields
from ..ring.driver import ParamGrads
from ..stats import row_info
from .softmax import (
    MaskedPartials,
    MaskedSoftmaxSteps,
    MaskedUpstream,
    SoftmaxPartials,
    SoftmaxSteps,
    _finite,
    _nan_unless,
    _poison,
    _scatter_to_columns,
)


class SmoothedPartials(NamedTuple):
    """The plain softmax partials plus the sum of the logits over the set (``total``)."""

    stats: Tensor  # [2, n] (max, rel) of the logits
    positive: Tensor  # [n] the positive logit where the set holds it, else 0
    total: Tensor  # [n] sum of the logits over the set
    count: Tensor  # [n] the number of logits in it: the row's classes, once every block is merged

    def losses(self, eps: float) -> Tensor:
        """(1 - eps) * (m - pos) + eps * (m - total / count) + r per row, NaN where the lse is not finite."""
        m, rel = self.stats[MAX], self.stats[REL]
        loss = (1.0 - eps) * (m - self.positive) + eps * (m - self.total / self.count) + rel
        return _nan_unless(_finite(self.stats), loss)

    def info(self) -> Tensor:
        return row_info(self.positive >= self.stats[MAX], self.positive, torch.ones_like(self.positive))


class SmoothedSoftmaxSteps(SoftmaxSteps):
    """:class:`infcl.ring.driver.RingLoss` for the softmax loss with label smoothing ``eps`` (no masks);
    ``n_cols`` / ``n_rows``: the global number of columns (rows), each row's (column's) class count."""

    def __init__(self, symmetric: bool, eps: float, n_cols: int, n_rows: int):
        super().__init__(symmetric)
        self.eps, self.n_cols, self.n_rows = float(eps), n_cols, n_rows

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> SmoothedPartials:
        stats, positive = SoftmaxPartials.empty(n, dtype, device)
        zeros = torch.zeros(2, n, dtype=dtype, device=device)
        return SmoothedPartials(stats, positive, zeros[0], zeros[1])

    @staticmethod
    def merge(acc: SmoothedPartials, part: SmoothedPartials) -> None:
        lse_merge(acc.stats, part.stats)
        acc.positive.add_(part.positive)
        acc.total.add_(part.total)
        acc.count.add_(part.count)

    def forward_step(self, backend: BlockBackend, block: Block, k_side=()):
        rows, col_stats = backend.forward_block(block, self.symmetric)
        rows = SoftmaxPartials.unpack(rows)
        acc = rows.stats.dtype
        q, k = block.q.to(acc), block.k.to(acc)
        row_total = torch.mv(q, _column_sums(k)).mul_(block.scale)
        rows = SmoothedPartials(rows.stats, rows.positive, row_total, torch.full_like(row_total, k.shape[0]))
        if not self.symmetric:
            return rows, None
        col_total = torch.mv(k, _column_sums(q)).mul_(block.scale)
        col_positive = _scatter_to_columns(rows.positive, block.pos, block.k.shape[0])
        return rows, SmoothedPartials(col_stats, col_positive, col_total, torch.full_like(col_total, q.shape[0]))

    def _backward_block(self, backend: BlockBackend, block: Block, dq: Tensor, dk: Tensor) -> Tensor:
        """The plain loss's block gradient plus the smoothing terms (the scale gradient's row and column parts)."""
        dscale = super()._backward_block(backend, block, dq, dk)
        own, owner = _smoothing_terms(block, self.eps, self.n_cols, self.n_rows, dq, dk)
        return dscale + torch.cat((own, owner))

    def losses(self, part: SmoothedPartials) -> Tensor:
        return part.losses(self.eps)

    def saved(self, part: SmoothedPartials) -> Tuple[Tensor, ...]:
        return (part.stats,)


def _smoothing_terms(
    block: Block, eps: float, n_cols: int, n_rows: int, dq: Tensor, dk: Tensor
) -> Tuple[Tensor, Tensor]:
    """Add the block's g * eps * Y - g * eps / n terms to dq, dk in place (g: the block's ``g_row`` and, symmetric,
    ``g_col``); return the scale gradient's (rows' part [1], columns' part [1]). Few passes over the [n, D]
    operands: one gather, one row-wise dot, two sums, two matrix-vector products, and one update of each of dq and
    dk per kind of term (the rank-one terms of both directions as one rank-two ``addmm_``)."""
    acc, scale = dq.dtype, block.scale
    q, k = block.q.to(acc), block.k.to(acc)
    inside = block.pos >= 0
    idx = torch.where(inside, block.pos, 0)
    k_pos = k.index_select(0, idx)  # [Bq, D] each row's positive column (row 0 where elsewhere: weight 0)
    raw_pos = torch.bmm(q[:, None, :], k_pos[:, :, None]).view(-1)  # q_i . k_pos (batched dots: one pass)
    k_sum, q_sum = _column_sums(k), _column_sums(q)

    w = torch.where(inside, block.g_row * eps, 0.0)  # dS[i, pos_i] += eps * g_i
    u_row = block.g_row * (eps / n_cols)  # dS[i, :] -= eps * g_i / n
    q_u = torch.mv(q.T, u_row)  # sum_i u_i q_i
    own = (w * raw_pos).sum() - torch.dot(q_u, k_sum)
    owner = torch.zeros((), dtype=acc, device=dq.device)
    # dq -= scale * (u_row (x) k_sum [+ 1 (x) k^T u_col]); dk -= scale * (1 (x) q^T u_row [+ u_col (x) q_sum])
    dq_left, dq_right = [u_row], [k_sum]
    dk_left, dk_right = [torch.ones_like(k_sum[:1]).expand(k.shape[0])], [q_u]
    if block.g_col is not None:
        w = w + torch.where(inside, block.g_col.index_select(0, idx) * eps, 0.0)  # dS[i, pos_i] += eps * g_col
        w_col = w - torch.where(inside, block.g_row * eps, 0.0)
        u_col = block.g_col * (eps / n_rows)  # dS[:, j] -= eps * g_col_j / n
        k_u = torch.mv(k.T, u_col)  # sum_j u_col_j k_j
        owner = (w_col * raw_pos).sum() - torch.dot(k_u, q_sum)
        dq_left.append(torch.ones_like(u_row))
        dq_right.append(k_u)
        dk_left.append(u_col)
        dk_right.append(q_sum)
    neg_scale = -scale
    dq.addmm_(torch.stack(dq_left, dim=1), torch.stack(dq_right) * neg_scale)
    dk.addmm_(torch.stack(dk_left, dim=1), torch.stack(dk_right) * neg_scale)
    ws = w * scale
    dq.addcmul_(k_pos, ws[:, None])
    _add_rows(dk, idx, q * ws[:, None])
    return own.reshape(1), owner.reshape(1)


def _column_sums(x: Tensor) -> Tensor:
    """[D] the sum of x's rows, as a matrix-vector product (BLAS: one pass; ``sum(dim=0)`` was 30x slower on
    the 2-vCPU test machine)."""
    return torch.mv(x.T, x.new_ones(x.shape[0]))


def _add_rows(out: Tensor, index: Tensor, rows: Tensor) -> None:
    """out[index[i]] += rows[i], deterministically: index_put_'s sorted accumulation (a column may be several
    rows' positive; no float atomics; 9x faster than index_add_'s scatter on the CPU here)."""
    out.index_put_((index,), rows, accumulate=True)


# --- with ids (infcl.masks): the uniform part over the columns that stay in the denominator -----------


class IdGroups(NamedTuple):
    """A block's ids as group numbers, found once per block step (no host synchronization, unlike ``unique``):
    each line's group among its own side's sorted ids (its id's first occurrence there) and its group among the
    other side's, or that side's size where its id is absent there (a zero row past that side's table). Each
    same-id sum is then one ``index_put_`` into a table of one side's size and one ``index_select`` out of it:
    O((Bq + Bk) * D), deterministic (``index_put_``'s sorted accumulation). "rows" and "cols" are a direction's
    lines and the other side (:meth:`swapped` gives the column direction's view)."""

    rows: Tensor  # [n_rows] int64 each row's group among the rows' ids
    rows_in_cols: Tensor  # [n_rows] its group among the columns' ids, n_cols where absent
    cols: Tensor  # [n_cols] each column's group among the columns' ids
    cols_in_rows: Tensor  # [n_cols] its group among the rows' ids, n_rows where absent

    @classmethod
    def of(cls, q_ids: Tensor, k_ids: Tensor) -> "IdGroups":
        q_sorted, _ = torch.sort(q_ids)
        k_sorted, _ = torch.sort(k_ids)
        rows, cols = torch.searchsorted(q_sorted, q_ids), torch.searchsorted(k_sorted, k_ids)
        return cls(rows, _group_in(k_sorted, q_ids), cols, _group_in(q_sorted, k_ids))

    def swapped(self) -> "IdGroups":
        """The column direction's view: its lines are the k side."""
        return IdGroups(self.cols, self.cols_in_rows, self.rows, self.rows_in_cols)

    def cols_at_rows(self, values: Tensor) -> Tensor:
        """[n_rows, ...] for each row, the sum of the ``values`` ([n_cols, ...]) of the columns with its id."""
        return _table(values, self.cols).index_select(0, self.rows_in_cols)

    def rows_at_cols(self, values: Tensor) -> Tensor:
        """[n_cols, ...] for each column, the sum of the ``values`` ([n_rows, ...]) of the rows with its id."""
        return _table(values, self.rows).index_select(0, self.cols_in_rows)


def _group_in(sorted_ids: Tensor, ids: Tensor) -> Tensor:
    """Each id's group among ``sorted_ids`` (its first occurrence), or len(sorted_ids) where it is absent."""
    n = sorted_ids.shape[0]
    if n == 0:
        return torch.zeros_like(ids)
    at = torch.searchsorted(sorted_ids, ids).clamp_(max=n - 1)
    return torch.where(sorted_ids[at] == ids, at, n)


def _table(values: Tensor, groups: Tensor) -> Tensor:
    """[n + 1, ...] the sum of ``values`` per group (row n: the absent ids' zero)."""
    table = values.new_zeros((values.shape[0] + 1,) + values.shape[1:])
    return table.index_put_((groups,), values, accumulate=True)


class SmoothedMaskedPartials(NamedTuple):
    """The masked partials (:class:`~.softmax.MaskedPartials`) plus the sum and number of the logits that stay
    in the denominator."""

    stats: Tensor
    pos_stats: Tensor
    pos_sum: Tensor
    pos_count: Tensor
    total: Tensor  # [n] sum of the kept logits
    count: Tensor  # [n] their number

    def masked(self) -> MaskedPartials:
        return MaskedPartials(self.stats, self.pos_stats, self.pos_sum, self.pos_count)

    def losses(self, kind: str, eps: float) -> Tensor:
        """(1 - eps) * the masked loss + eps * ((m - total / count) + r)."""
        m, rel = self.stats[MAX], self.stats[REL]
        return (1.0 - eps) * self.masked().losses(kind) + eps * ((m - self.total / self.count) + rel)

    def info(self) -> Tensor:
        return self.masked().info()


class SmoothedMaskedUpstream(NamedTuple):
    """:class:`~.softmax.MaskedUpstream` plus each row's number of kept columns."""

    stats: Tensor
    grad: Tensor
    pos_stats: Tensor
    pos_count: Tensor
    count: Tensor

    def block_fields(self, side: str, kind: str) -> dict:
        return MaskedUpstream(*self[:4]).block_fields(side, kind)


class SmoothedIdsSteps(MaskedSoftmaxSteps):
    """:class:`infcl.ring.driver.RingLoss` for label smoothing with ids (no guide). Kept columns: every column
    but the same-id ones that are not the row's positive (None), or every column ("mean", "sum": ids exclude
    nothing). The uniform part and its gradient come from same-id sums (:class:`IdGroups`) of the features
    per block; the target's positive part is the one-hot (None), 1 / |P| on the same-id columns ("mean"), or
    the softmax over them ("sum": the tiles' own, scaled by 1 - eps through the positives' stats,
    :meth:`upstream`)."""

    def __init__(self, symmetric: bool, eps: float, masks: MaskOptions):
        eps = float(eps)
        if eps == 1.0 and masks.multi_positive == "sum":  # the positives' part has weight 0: "sum" is "mean"
            masks = replace(masks, multi_positive="mean")
        super().__init__(symmetric, masks)
        self.eps, self.multi_positive = eps, masks.multi_positive

    def init_rows(self, n: int, dtype: torch.dtype, device: torch.device) -> SmoothedMaskedPartials:
        zeros = torch.zeros(2, n, dtype=dtype, device=device)
        return SmoothedMaskedPartials(*MaskedPartials.empty(n, dtype, device), zeros[0], zeros[1])

    def merge(self, acc: SmoothedMaskedPartials, part: SmoothedMaskedPartials) -> None:
        merge_masked_fields(acc[:4], part[:4], self.kind)
        acc.total.add_(part.total)
        acc.count.add_(part.count)

    def _kept(self, x, y, groups: Optional[IdGroups], part: MaskedPartials, same_pos, scale):
        """(total, count) of the kept entries of x's rows against y's rows (one direction of the block)."""
        total = torch.mv(x, _column_sums(y))
        count = torch.full_like(total, y.shape[0])
        if self.multi_positive is None:
            total = total - torch.linalg.vecdot(x, groups.cols_at_rows(y))
            count = count - groups.cols_at_rows(torch.ones_like(y[:, 0]))
        total = total.mul_(scale)
        if self.multi_positive is None:  # the positive stays: its logit as the tile read it, and one count
            total = total + torch.where(same_pos, part.pos_sum, 0.0)
            count = count + torch.where(same_pos, part.pos_count, 0.0)
        return total, count

    def forward_step(self, backend: BlockBackend, block: Block, k_side=()):
        rows, cols = super().forward_step(backend, block, k_side)
        block = self._block(block, k_side)
        acc = rows.stats.dtype
        q, k = block.q.to(acc), block.k.to(acc)
        same_pos = _same_at_positive(block)
        ids = block.masks
        groups = IdGroups.of(ids.q_ids, ids.k_ids) if self.multi_positive is None else None
        total, count = self._kept(q, k, groups, rows, same_pos, block.scale)
        rows = SmoothedMaskedPartials(*rows, total, count)
        if cols is None:
            return rows, None
        col_same = _scatter_to_columns(same_pos.to(acc), block.pos, k.shape[0]) > 0
        total, count = self._kept(k, q, None if groups is None else groups.swapped(), cols, col_same, block.scale)
        return rows, SmoothedMaskedPartials(*cols, total, count)

    def backward_step(self, backend, block: Block, rows, cols, dq: Tensor, dk: Tensor, k_side=()) -> ParamGrads:
        grads = super().backward_step(backend, block, rows, cols, dq, dk, k_side)
        block = self._block(block, k_side)
        own, owner = _smoothing_id_terms(block, rows, cols, self.eps, self.multi_positive, dq, dk)
        return ParamGrads(own=grads.own + own, owner=grads.owner + owner)

    def losses(self, part: SmoothedMaskedPartials) -> Tensor:
        return part.losses(self.kind, self.eps)

    def upstream(self, saved: Tuple[Tensor, ...], grad: Tensor) -> SmoothedMaskedUpstream:
        part = SmoothedMaskedPartials(*saved)
        up = part.masked().upstream(grad)
        if self.multi_positive == "sum":  # Y' = (1 - eps) * Y: the positives' log-sum raised by -log(1 - eps)
            pos_max, pos_rel = up.pos_stats
            up = up._replace(pos_stats=torch.stack((pos_max, pos_rel - math.log1p(-self.eps))))
        return SmoothedMaskedUpstream(*up, torch.where(part.pos_count > 0, part.count, 1.0))


class SmoothedKeptSteps(SmoothedIdsSteps):
    """:class:`infcl.ring.driver.RingLoss` for label smoothing with any mask options (a guide, ids, any
    ``multi_positive``) on a backend whose masked tiles sum the kept logits (``backend.kept_sums``: the torch
    tiles, the native kernel, the Triton kernels, the chunked route; a guide needs it). Which columns a guide
    leaves out is decided by the guide scores inside the tiles, so the tiles that decide it also sum and count
    what stays (``Block.kept_sums``: [8, n] partials) and, in the backward, subtract the uniform target's
    ``u = eps * g / n_kept`` from dS on every kept entry (``Block.row_uniform`` / ``col_uniform``): one decision,
    by the same guide product and threshold, for the denominator and the uniform target. The positives' part of
    the target, (1 - eps) * Y, is the tiles' own where their positives' inputs can scale it: "sum" (the positives'
    log-sum raised by -log(1 - eps)) and "mean" below eps = 1 (the tiles' 1 / c at the positives with c raised to
    |P| / (1 - eps)); else (the one-hot of None; "mean" at eps = 1, whose Y has weight 0) eps * g * Y is added
    back here as with ids alone."""

    def __init__(self, symmetric: bool, eps: float, masks: MaskOptions):
        super().__init__(symmetric, eps, masks)
        self.mean_in_tiles = self.multi_positive == "mean" and self.eps < 1.0

    def upstream(self, saved: Tuple[Tensor, ...], grad: Tensor) -> SmoothedMaskedUpstream:
        up = super().upstream(saved, grad)
        if self.mean_in_tiles:  # Y' = (1 - eps) / |P| on the positives: the tiles' 1 / c at c = |P| / (1 - eps)
            up = up._replace(pos_count=up.pos_count / (1.0 - self.eps))
        return up

    def forward_step(self, backend: BlockBackend, block: Block, k_side=()):
        block = self._block(block, k_side, kept_sums=True)
        rows, cols = backend.forward_block(block, self.symmetric)
        rows = _kept_partials(rows, block.masks.row_threshold)
        return rows, (None if cols is None else _kept_partials(cols, block.masks.col_threshold))

    def backward_step(self, backend, block: Block, rows, cols, dq: Tensor, dk: Tensor, k_side=()) -> ParamGrads:
        fields = {**rows.block_fields("row", self.kind), "row_uniform": rows.grad * (self.eps / rows.count)}
        if cols is not None:
            fields.update(cols.block_fields("col", self.kind), col_uniform=cols.grad * (self.eps / cols.count))
        dscale = backend.backward_block(self._block(block, k_side, **fields), dq, dk)
        if self.multi_positive == "sum" or self.mean_in_tiles:  # nothing left: the tiles scaled Y
            return ParamGrads(own=dscale[:1], owner=dscale[1:])
        own, owner = _smoothing_id_terms(
            self._block(block, k_side), rows, cols, self.eps, self.multi_positive, dq, dk, False
        )
        return ParamGrads(own=dscale[:1] + own, owner=dscale[1:] + owner)


def _kept_partials(packed: Tensor, threshold: Optional[Tensor]) -> SmoothedMaskedPartials:
    """A backend's ``[8, n]`` masked forward result (:data:`infcl.masks.KEPT_ROWS`) as named partials, with a NaN
    guide threshold's NaN in its line's max (:class:`~.softmax.MaskedSoftmaxSteps`)."""
    part = SmoothedMaskedPartials(*MaskedPartials.unpack(packed), packed[KEPT_SUM], packed[KEPT_COUNT])
    _poison(part, threshold)
    return part


def _same_at_positive(block: Block) -> Tensor:
    """[Bq] bool: the row's positive lies in this block and has the row's id."""
    inside = block.pos >= 0
    idx = torch.where(inside, block.pos, 0)
    return inside & (block.masks.q_ids == block.masks.k_ids.index_select(0, idx))


def _direction_terms(x, y, dx, dy, groups, up, eps, multi_positive, scale, same_pos, w_extra, uniform):
    """One direction's terms, added to dx [na, D] and dy [nb, D] in place (no [n, D] temporary but the same-id
    sums): dS[a, b] += w_a at the positive (None: eps * g_a, given by the caller), +v_a on the same-id entries
    ("mean": eps * g_a / |P|, the target's eps * g * Y back; "sum": none, the tiles scaled Y) and, where
    ``uniform`` (the tiles did not subtract it), -u_a on every kept entry: -u_a on every entry and, under None,
    +u_a back on the excluded same-id ones. Returns (the scale's part, w [na]); the one-hot terms of w are the
    caller's."""
    w = w_extra if multi_positive is None else torch.zeros_like(up.grad)
    v = up.grad * eps / up.pos_count if multi_positive == "mean" else None
    part = torch.zeros((), dtype=x.dtype, device=x.device)
    if uniform:
        u = up.grad * eps / up.count
        y_sum, x_u = _column_sums(y), torch.mv(x.T, u)
        dx.addr_(u * -scale, y_sum)
        dy.sub_(x_u * scale)
        part = torch.dot(x_u, y_sum).neg()
        if multi_positive is None:
            v = u
            w = w - torch.where(same_pos, u, 0.0)
    if v is not None:
        y_same = groups.cols_at_rows(y)
        dx.addcmul_(y_same, (v * scale)[:, None])
        dy.add_(groups.rows_at_cols(x * (v * scale)[:, None]))
        part = part + (v * torch.linalg.vecdot(x, y_same)).sum()
    return part, w


def _smoothing_id_terms(block: Block, rows, cols, eps: float, multi_positive, dq: Tensor, dk: Tensor, uniform=True):
    """Add the smoothing's terms with ids to dq, dk in place (``uniform``: the uniform part too, else only the
    positives' eps * g * Y, the tiles having subtracted the rest); return the scale gradient's (rows' part [1],
    columns' part [1])."""
    acc, scale = dq.dtype, block.scale
    q, k = block.q.to(acc), block.k.to(acc)
    inside = block.pos >= 0
    idx = torch.where(inside, block.pos, 0)
    same_pos = _same_at_positive(block) if uniform else None
    one_hot = multi_positive is None
    # same-id sums: the uniform part's under None, the target's under "mean"
    needs_groups = (one_hot and uniform) or multi_positive == "mean"
    groups = IdGroups.of(block.masks.q_ids, block.masks.k_ids) if needs_groups else None
    w_row = torch.where(inside, rows.grad * eps, 0.0) if one_hot else 0.0
    own, w = _direction_terms(q, k, dq, dk, groups, rows, eps, multi_positive, scale, same_pos, w_row, uniform)
    owner = torch.zeros((), dtype=acc, device=dq.device)
    if cols is not None:
        col_same = _scatter_to_columns(same_pos.to(acc), block.pos, k.shape[0]) > 0 if uniform else None
        w_col = torch.where(inside, cols.grad.index_select(0, idx) * eps, 0.0) if one_hot else 0.0
        w_col_cols = _scatter_to_columns(torch.as_tensor(w_col, dtype=acc).expand(q.shape[0]), block.pos, k.shape[0])
        col_groups = None if groups is None else groups.swapped()
        owner, wc = _direction_terms(
            k, q, dk, dq, col_groups, cols, eps, multi_positive, scale, col_same, w_col_cols, uniform
        )
    if not one_hot:  # w is 0: no one-hot terms
        return own.reshape(1), owner.reshape(1)
    k_pos = k.index_select(0, idx)
    raw_pos = torch.linalg.vecdot(q, k_pos)
    own = own + (w * raw_pos).sum()
    if cols is not None:
        wc_rows = torch.where(inside, wc.index_select(0, idx), 0.0)  # back to the rows holding each positive
        owner = owner + (wc_rows * raw_pos).sum()
        w = w + wc_rows
    ws = w * scale
    dq.addcmul_(k_pos, ws[:, None])
    _add_rows(dk, idx, q * ws[:, None])
    return own.reshape(1), owner.reshape(1)
