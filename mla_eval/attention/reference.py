"""Torch reference of the cache writer and of MLA attention over the paged cache (any device).

Cache: `uint8 [num_blocks, block_size, record_bytes]`, contiguous; slot s is record
`s % block_size` of block `s // block_size`, i.e. row s of the flat `[num_slots, record_bytes]` view.

Query slot lists (the same for the GPU kernels):
- dense causal: `block_table [N, max_blocks]` int32 (one row per query; queries of one sequence
  repeat its row) and `seq_lens [N]` int32; query n sees keys j = 0 .. seq_lens[n] - 1 (causal:
  seq_lens[n] = position + 1), key j living in slot block_table[n, j // block_size] * block_size
  + j % block_size. Entries past the last block used are never read.
- sparse top-k: `indices [N, topk]` int32/int64 of global slot ids; ids < 0 or >= num_slots are
  invalid (-1 is the padding DSA indexers emit). A repeated id counts as often as it appears.

Math (float32 throughout, after exact dequantisation by `mla_eval.formats.decode`):
    s_hj = softmax_scale * q_h . K_j       q [N, H, 576] = (q_nope absorbed into latent space, q_pe)
    out_h = sum_j e^{s_hj - m} K_j[:512] / (sum_j e^{s_hj - m} + e^{sink_h - m})
    lse_h = m + log sum_j e^{s_hj - m}      (valid keys only; the sink is not part of the lse)
with m the row max over valid keys. With `p_fp8` (attention math fp8-qp,
`mla_eval.attention.semantics`) the weights e^{s_hj - m} are rounded to E4M3 before they multiply
K_j[:512]; the denominator keeps the float32 weights. Masked scores are filled with the finite float32 minimum and
their weights set to exactly 0, so a row without any valid key gives out = 0 and lse = -inf (no NaN,
with or without a sink).
"""

from __future__ import annotations

import torch

from mla_eval.attention.semantics import quantize_p
from mla_eval.formats import decode, encode, get_format
from mla_eval.formats.spec import LATENT_DIM, ROPE_DIM

QK_DIM = LATENT_DIM + ROPE_DIM  # the absorbed query / key: latent + rope
_ELEMS_PER_CHUNK = 1 << 22  # score elements (query x head x key) held at once: bounds the memory used
# Sparse lists gather each query's own keys [n, L, 576] float32: 576 / heads times the scores' size, so a model of
# few heads needs this second bound (a 2-head model with top-k 256 held 4.8 GiB of keys for 8192 queries at once).
# It binds only below 36 heads (2^22 / (2^28 / (4 * 576))); at the 64 and 128 heads of GLM-5 and DeepSeek the score
# bound is the smaller and the blocks are what they always were.
_GATHERED_KEY_BYTES = 1 << 28


def write_cache(
    spec,
    latent: torch.Tensor,
    rope: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: torch.Tensor,
    outer_scale=None,
    layer: int | None = None,
) -> None:
    """Encode latent [T, 512] and rope [T, 64] into `cache` at `slot_mapping` [T] (int64, < 0 skipped).

    Slots must be distinct. The record bytes are `mla_eval.formats.encode` of the inputs; `layer`
    only labels error messages.
    """
    spec = get_format(spec)
    records = encode(spec, latent, rope, outer_scale=outer_scale, layer=layer)
    flat = cache.view(-1, spec.record_bytes)
    keep = slot_mapping >= 0
    flat[slot_mapping[keep].to(torch.long)] = records[keep.to(records.device)]


def dense_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, max(seq_lens)] int64 slot ids of the dense causal lists, -1 past each query's length."""
    n = block_table.shape[0]
    length = int(seq_lens.max()) if n else 0
    j = torch.arange(length, device=block_table.device)
    blocks = block_table.long().gather(1, (j // block_size).clamp(max=block_table.shape[1] - 1).expand(n, -1))
    slots = blocks * block_size + j % block_size
    return torch.where(j < seq_lens.long().unsqueeze(1), slots, torch.full_like(slots, -1))


def mla_attention(
    spec,
    q: torch.Tensor,
    cache: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
    outer_scale=None,
    p_fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [N, H, 512] float32, lse [N, H] float32 (natural log) for q [N, H, 576].

    Give either (`block_table`, `seq_lens`) for dense causal lists or `indices` for sparse top-k.
    `sink` [H] float32 per-head logits (optional); `outer_scale` s_l as for `decode`; `p_fp8`
    rounds the softmax weights to E4M3 before P.V (see the module docstring).
    """
    spec = get_format(spec)
    num_slots = cache.shape[0] * cache.shape[1]
    if indices is None and block_table.shape[0] > 1:
        return _dense_by_sequence(spec, q, cache, block_table, seq_lens, softmax_scale, sink, outer_scale, p_fp8)
    if indices is not None:
        slots = indices.long()
        slots = torch.where((slots >= 0) & (slots < num_slots), slots, torch.full_like(slots, -1))
    else:
        slots = dense_slots(block_table, seq_lens, cache.shape[1])
    n, h = q.shape[0], q.shape[1]
    out = torch.zeros(n, h, LATENT_DIM, dtype=torch.float32, device=q.device)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q.device)
    if n == 0 or slots.shape[1] == 0:
        return out, lse

    # Decode each distinct slot once.
    valid = slots >= 0
    used, inverse = torch.unique(torch.where(valid, slots, torch.zeros_like(slots)), return_inverse=True)
    lat, rope = decode(spec, cache.view(-1, spec.record_bytes)[used], outer_scale=outer_scale)
    keys = torch.cat([lat, rope], dim=-1)  # [U, 576] float32

    qf = q.to(torch.float32)
    sink_f = sink.to(torch.float32) if sink is not None else None
    step = max(1, min(_ELEMS_PER_CHUNK // max(1, h * slots.shape[1]), _GATHERED_KEY_BYTES // (4 * QK_DIM * slots.shape[1])))
    for a in range(0, n, step):
        b = min(n, a + step)
        k = keys[inverse[a:b]]  # [n, L, 576]
        s = torch.einsum("nhd,nld->nhl", qf[a:b], k) * softmax_scale
        out[a:b], lse[a:b] = _softmax_read(s, valid[a:b].unsqueeze(1), k[..., :LATENT_DIM], "nhl,nld->nhd", sink_f, p_fp8)
    return out, lse


def _softmax_read(s, ok, values, contract: str, sink, p_fp8: bool = False):
    """Masked softmax of scores s [n, H, L] (ok broadcastable: valid keys) read out of `values`
    with `contract` (einsum), the sink in the denominator only. -> out [n, H, 512], lse [n, H]."""
    s = torch.where(ok, s, torch.full_like(s, torch.finfo(torch.float32).min))
    m = s.amax(dim=-1, keepdim=True)
    e = torch.where(ok, torch.exp(s - m), torch.zeros_like(s))
    total = e.sum(dim=-1, keepdim=True)
    denom = total if sink is None else total + torch.exp(sink.view(1, -1, 1) - m)
    num = torch.einsum(contract, quantize_p(e) if p_fp8 else e, values)
    has = total > 0
    out = torch.where(has, num / torch.where(has, denom, torch.ones_like(denom)), torch.zeros_like(num))
    lse = torch.where(has, m + torch.log(torch.where(has, total, torch.ones_like(total))), torch.full_like(m, float("-inf")))
    return out, lse.squeeze(-1)


def _dense_by_sequence(spec, q, cache, block_table, seq_lens, softmax_scale, sink, outer_scale, p_fp8=False):
    """Dense lists where many queries share one block-table row (prefill, teacher forcing): the
    row's keys are decoded once and every query of the row reads them in place (no per-query
    copy of the keys), each masked to its own length. Same math as the general path."""
    rows, inverse = torch.unique(block_table, dim=0, return_inverse=True)
    n, h = q.shape[0], q.shape[1]
    out = torch.zeros(n, h, LATENT_DIM, dtype=torch.float32, device=q.device)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q.device)
    for r in range(rows.shape[0]):
        sel = (inverse == r).nonzero().squeeze(1)
        lens = seq_lens[sel].long()
        length = int(lens.max()) if sel.numel() else 0
        if length == 0:
            continue
        slots = dense_slots(rows[r : r + 1], lens.max().view(1), cache.shape[1])[0]
        lat, rope = decode(spec, cache.view(-1, spec.record_bytes)[slots], outer_scale=outer_scale)
        keys = torch.cat([lat, rope], dim=-1)  # [L, 576]
        _read_keys(q, sel, keys, seq_lens, softmax_scale, sink, p_fp8, out, lse)
    return out, lse


def _read_keys(q, sel, keys, seq_lens, softmax_scale, sink, p_fp8, out, lse) -> None:
    """Queries q[sel] over the shared keys [L, 576], query n masked to its first seq_lens[n] keys;
    writes out[sel], lse[sel]. The one loop behind the dense prefill paths (cache and engine)."""
    h, length = q.shape[1], keys.shape[0]
    step = max(1, _ELEMS_PER_CHUNK // max(1, h * length))
    for a in range(0, sel.numel(), step):
        idx = sel[a : a + step]
        ok = (torch.arange(length, device=q.device).view(1, -1) < seq_lens[idx].long().view(-1, 1)).unsqueeze(1)
        s = torch.einsum("nhd,ld->nhl", q[idx].to(torch.float32), keys) * softmax_scale
        sink_f = None if sink is None else sink.to(torch.float32)
        out[idx], lse[idx] = _softmax_read(s, ok, keys[:, :LATENT_DIM], "nhl,ld->nhd", sink_f, p_fp8)


def mla_attention_chunk(
    spec,
    q: torch.Tensor,
    cache: torch.Tensor,
    *,
    softmax_scale: float,
    block_table: torch.Tensor,
    prefix_len: int,
    chunk_keys: torch.Tensor,
    sink: torch.Tensor | None = None,
    outer_scale=None,
    p_fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Engine chunked-prefill attention (`mla_eval.attention.semantics`, engine:C) of B sequences.

    q [B * T, H, 576]: the T queries of each sequence's current chunk, at positions prefix_len ..
    prefix_len + T - 1; `block_table` [B, max_blocks]: each sequence's row once. Query i of a
    sequence reads the keys of positions < prefix_len from the quantised `cache` and the keys of
    its chunk up to itself from `chunk_keys` [B, T, 576] (float32, the fresh latent and rope):
    one softmax over the mixed keys. -> out [B * T, H, 512], lse [B * T, H] float32.
    """
    spec = get_format(spec)
    b, t = chunk_keys.shape[:2]
    n, h = q.shape[0], q.shape[1]
    if n != b * t or block_table.shape[0] != b:
        raise ValueError(f"q holds {n} queries and block_table {block_table.shape[0]} rows for {b} x {t} chunk keys")
    out = torch.zeros(n, h, LATENT_DIM, dtype=torch.float32, device=q.device)
    lse = torch.full((n, h), float("-inf"), dtype=torch.float32, device=q.device)
    seq_lens = (prefix_len + 1 + torch.arange(t, device=q.device)).repeat(b)
    for r in range(b):
        keys = chunk_keys[r].to(torch.float32)
        if prefix_len > 0:
            row = block_table[r : r + 1]
            slots = dense_slots(row, torch.tensor([prefix_len], device=row.device), cache.shape[1])[0]
            lat, rope = decode(spec, cache.view(-1, spec.record_bytes)[slots], outer_scale=outer_scale)
            keys = torch.cat([torch.cat([lat, rope], dim=-1), keys], dim=0)  # [prefix + T, 576]
        sel = torch.arange(r * t, (r + 1) * t, device=q.device)
        _read_keys(q, sel, keys, seq_lens, softmax_scale, sink, p_fp8, out, lse)
    return out, lse
