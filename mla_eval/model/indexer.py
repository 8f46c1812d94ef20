"""Our own DSA indexer top-k: which cache positions each query of a DeepSeek-V3.2 / GLM-5 layer reads.

Why own it: the stock `Indexer.forward` renamed its cache keyword (`past_key_values` in transformers
5.17, `cache` in 5.24+), so calling it ties us to one version. The computation is small and reads
only the indexer's parameters (`wq_b`, `wk`, `k_norm`, `weights_proj`), which are named the same in
every version we support. Steps, as in transformers 5.17.0 and 5.25.0
`models/{deepseek_v32,glm_moe_dsa}/modeling_*.py` (`*Indexer.forward`, identical apart from the keyword):

  q = wq_b(q_resid)                      [B, S, H, D]   (q_resid = q_a_layernorm(q_a_proj(x)))
  k = k_norm(wk(x))                      [B, S, D]      (LayerNorm, eps 1e-6)
  RoPE on the FIRST qk_rope_head_dim (64) dims of q and k, the rest passes through;
      deepseek_v32: half-split (non-interleaved) rotation; glm_moe_dsa: interleaved pairs
  scores[b,s,t] = sum_h w[b,s,h] * relu(q[b,s,h] . k[b,t] * D^-0.5),  w = weights_proj(x) * H^-0.5
  causal mask (future keys -inf), then top-k (index_topk, or every key when fewer).

The reference DeepSeek code also applies a Hadamard rotation and fp8 scoring; transformers skips
both (the rotation is orthogonal), and so do we: the test oracle is the installed transformers.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# model_type -> how the indexer rotates the rope part of its q and k (see module docstring)
INDEXER_ROPE = {"deepseek_v32": "half", "glm_moe_dsa": "interleaved"}
INDEXER_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")

# Query rows scored at once: the fp32 [B, rows, H, T] score block of one chunk holds at most this many bytes
# (one row at least). Each query row's scores, mask and top-k depend on that row alone, so the chunking
# changes no selected index (tests/test_indexer.py holds chunked == unchunked, ties included); memory is
# O(ctx) per chunk instead of O(heads x ctx^2) per layer (64 heads x 8192^2 fp32 would be 16 GiB).
SCORE_BLOCK_BYTES = 1 << 28


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kind: str) -> torch.Tensor:
    """Rotate x [B, S, n, r] by cos/sin [B, S, r] (`cat(freqs, freqs)` as the rotary embedding makes them)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if kind == "half":
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
    # interleaved pairs (x0, x1), (x2, x3)...: each pair turns by one angle; like transformers, the
    # output holds the pairs' first elements then their second ones (q and k alike, so q.k is unchanged)
    cos, sin = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@torch.no_grad()
def indexer_topk(indexer: torch.nn.Module, model_type: str, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor], index_topk: int,
                 block_bytes: int | None = None) -> torch.Tensor:
    """Top-k key positions [B, S, k] (int32, within the window) of a whole-window forward.

    hidden_states [B, S, hidden]; q_resid [B, S, q_lora_rank]; position_embeddings (cos, sin) [B, S, 64]
    as handed to the attention module. k = min(index_topk, S). Rows with fewer than k visible keys
    fill the rest with future positions (masked scores), as the stock indexer does; readers drop them.
    Query rows are scored `block_bytes` (default SCORE_BLOCK_BYTES) of fp32 scores at a time.
    """
    bsz, seq, _ = hidden_states.shape
    k_sel = min(index_topk, seq)
    out = torch.empty(bsz, seq, k_sel, dtype=torch.int32, device=hidden_states.device)
    for s0, s1, index in index_score_blocks(indexer, model_type, hidden_states, q_resid, position_embeddings,
                                            block_bytes):
        out[:, s0:s1] = index.topk(k_sel, dim=-1).indices
    return out


@torch.no_grad()
def index_score_blocks(indexer: torch.nn.Module, model_type: str, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor],
                       block_bytes: int | None = None) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(s0, s1, index scores [B, s1 - s0, S] float32 of query rows s0..s1-1, future keys -inf), block by block."""
    kind = INDEXER_ROPE[model_type]
    bsz, seq, _ = hidden_states.shape
    heads, dim = indexer.n_heads, indexer.head_dim
    rope_d = position_embeddings[0].shape[-1]
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(bsz, seq, heads, dim)
    q = torch.cat([_rotate(q[..., :rope_d], cos, sin, kind), q[..., rope_d:]], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    k = torch.cat([_rotate(k[..., :rope_d], cos, sin, kind), k[..., rope_d:]], dim=-1).squeeze(2)  # [B, S, D]
    w = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float() * heads**-0.5  # [B, S, H]
    kf = k.float().transpose(-1, -2).unsqueeze(1)  # [B, 1, D, T]
    scale = dim**-0.5
    rows = max(1, (block_bytes or SCORE_BLOCK_BYTES) // (4 * bsz * heads * seq))
    key_pos = torch.arange(seq, device=hidden_states.device)
    for s0 in range(0, seq, rows):
        s1 = min(seq, s0 + rows)
        scores = torch.matmul(q[:, s0:s1].float(), kf).mul_(scale).relu_()  # [B, s, H, T]
        index = torch.matmul(w[:, s0:s1].unsqueeze(-2), scores).squeeze(-2)  # [B, s, T]
        del scores
        future = key_pos.view(1, -1) > torch.arange(s0, s1, device=key_pos.device).view(-1, 1)
        yield s0, s1, index.masked_fill_(future, float("-inf"))
