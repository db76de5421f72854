"""GradCache with cal_maxsim_loss: token embeddings [B, L, D] are the cached representations (one padded length for
the whole batch, the masks passed to the loss as loss kwargs), and every parameter's gradient equals the one full
batch's forward and backward."""

import pytest
import torch
from torch import nn

from infcl import GradCache, cal_maxsim_loss
from infcl.backends import unavailable_reason

NATIVE_REASON = unavailable_reason("cpu", torch.device("cpu"))
needs_native = pytest.mark.skipif(NATIVE_REASON is not None, reason=f"native kernel unavailable: {NATIVE_REASON}")


class TokenEncoder(nn.Module):
    """Token ids [B, L] -> token embeddings [B, L, D] (an embedding, a projection and dropout)."""

    def __init__(self, vocab=50, width=12, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids):
        return self.proj(self.drop(torch.tanh(self.embed(ids))))


@pytest.mark.parametrize("backend", ("torch", pytest.param("cpu", marks=needs_native)))
def test_gradcache_matches_the_full_batch(backend):
    torch.manual_seed(0)
    q_enc, d_enc = TokenEncoder(), TokenEncoder()
    gen = torch.Generator().manual_seed(1)
    q_ids, d_ids = torch.randint(0, 50, (10, 5), generator=gen), torch.randint(0, 50, (10, 9), generator=gen)
    q_mask, d_mask = torch.rand(10, 5, generator=gen) > 0.2, torch.rand(10, 9, generator=gen) > 0.2
    q_mask[:, 0] = d_mask[:, 0] = True
    scale = torch.tensor(3.0, requires_grad=True)

    def loss_fn(q, d, **masks):
        return cal_maxsim_loss(q, d, scale=scale, length_normalize=True, backend=backend, **masks)

    cache = GradCache([q_enc, d_enc], chunk_sizes=3, loss_fn=loss_fn)
    torch.manual_seed(7)
    cached_loss = cache.cache_step(q_ids, d_ids, q_mask=q_mask, docs_mask=d_mask)
    cached = [p.grad.clone() for p in (*q_enc.parameters(), *d_enc.parameters(), scale)]
    for p in (*q_enc.parameters(), *d_enc.parameters(), scale):
        p.grad = None
    # The same chunks in the same order, with one graph: the RNG of each chunk as GradCache drew it.
    torch.manual_seed(7)
    q_chunks = [q_enc(c) for c in q_ids.split(3)]
    d_chunks = [d_enc(c) for c in d_ids.split(3)]
    loss = loss_fn(torch.cat(q_chunks), torch.cat(d_chunks), q_mask=q_mask, docs_mask=d_mask)
    loss.backward()
    full = [p.grad for p in (*q_enc.parameters(), *d_enc.parameters(), scale)]
    torch.testing.assert_close(cached_loss, loss.detach(), rtol=1e-6, atol=1e-6)
    for a, b in zip(cached, full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
