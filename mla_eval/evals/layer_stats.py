"""Per-layer error of a format, measured inside the same forward on the same activations.

- attention-output error: the latent-space attention output read from the quantised cache vs
  the output of exact float32 attention over the unquantised latents, for the same queries and
  the same keys (on DSA models, the top-k positions the layer's indexer chose: the reference is
  sparse too, so the error is the format's alone, not the sparsity's); relative L2 over all
  tokens and heads, and mean cosine per token-head;
- latent quantisation SNR: c_kv and k_pe vs what the cache actually stores (read back).
"""

from __future__ import annotations

import math

import torch

from mla_eval.formats import FormatSpec

# Query rows of the exact reference computed at once: the fp32 [B, H, rows, S] score block of one chunk holds at
# most this many bytes (one row at least), so the reference costs O(heads x ctx) memory, not the O(heads x ctx^2)
# of whole-window probabilities (128 heads x 8192^2 fp32 = 32 GiB per copy). Every query row's scores, mask and
# softmax depend on that row alone: chunked and whole-window outputs are equal bit for bit on CPU
# (tests/test_memory_bound.py).
EXACT_BLOCK_BYTES = 1 << 28


def exact_attention(q: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor, scale: float,
                    topk: torch.Tensor | None = None, block_bytes: int | None = None) -> torch.Tensor:
    """Causal float32 MLA attention of the last T queries q [B, T, H, 576] over the whole
    unquantised history latent [B, S, 512] / rope [B, S, 64]; returns [B, T, H, 512].

    With `topk` [B, T, k] (positions within the sequence; -1 or future positions are ignored, as the
    cache reader ignores them) each query reads only those positions: sparse attention over the
    same keys a DSA model's indexer chose. Computed `block_bytes` (default EXACT_BLOCK_BYTES) of scores at a time."""
    b, t, h, _ = q.shape
    s = latent.shape[1]
    kv = torch.cat([latent, rope], -1).float()
    out = torch.empty(b, t, h, latent.shape[-1], dtype=torch.float32, device=q.device)
    rows = max(1, (block_bytes or EXACT_BLOCK_BYTES) // (4 * b * h * s))
    keys = torch.arange(s, device=q.device).view(1, s)
    for a in range(0, t, rows):
        e = min(t, a + rows)
        scores = torch.einsum("bthd,bsd->bhts", q[:, a:e].float(), kv) * scale  # [B, H, rows, S]
        hidden = (keys > torch.arange(s - t + a, s - t + e, device=q.device).view(-1, 1)).expand(b, e - a, s)
        if topk is not None:
            idx = topk[:, a:e].long()
            chosen = torch.zeros(b, e - a, s + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(-1, torch.where((idx >= 0) & (idx < s), idx, s), True)  # invalid ones land in slot s
            hidden = hidden | ~chosen[..., :s]
        scores.masked_fill_(hidden.unsqueeze(1), torch.finfo(torch.float32).min)
        out[:, a:e] = torch.einsum("bhts,bsc->bthc", scores.softmax(-1), kv[..., :512])
    return out


class LayerStats:
    def __init__(self, num_layers: int) -> None:
        self.err2 = [0.0] * num_layers
        self.ref2 = [0.0] * num_layers
        self.cos_sum = [0.0] * num_layers
        self.cos_n = [0] * num_layers
        self.sig = {"latent": [0.0] * num_layers, "rope": [0.0] * num_layers}
        self.noise = {"latent": [0.0] * num_layers, "rope": [0.0] * num_layers}

    def observers(self, spec: FormatSpec):
        def observe(ev) -> None:
            sess, layer = ev.session, ev.layer
            t = ev.latent.shape[1]
            start = sess.lengths[layer] - t
            lat_hat, rope_hat = sess.read_back(layer, start, t)
            for key, x, xh in (("latent", ev.latent, lat_hat), ("rope", ev.rope, rope_hat)):
                x = x.float()
                self.sig[key][layer] += float((x * x).sum())
                self.noise[key][layer] += float(((x - xh) ** 2).sum())
            lat, rope = sess.exact[layer]
            scale = sess.last_scale[layer]
            ref = exact_attention(ev.q, lat, rope, scale, topk=ev.topk)
            out, flat = ev.out.reshape(-1, 512), ref.view(-1, 512)
            rows = max(1, EXACT_BLOCK_BYTES // (4 * 512))  # cosines a block of rows at a time: each row's alone
            cos = torch.cat([
                torch.nn.functional.cosine_similarity(out[i : i + rows], flat[i : i + rows], dim=-1, eps=1e-30)
                for i in range(0, out.shape[0], rows)
            ])
            # the sums run once over whole tensors (the same order as ever); one [B, T, H, 512] scratch besides ref
            scratch = torch.mul(ref, ref)
            self.ref2[layer] += float(scratch.sum())
            torch.sub(ev.out, ref, out=scratch)
            self.err2[layer] += float(scratch.mul_(scratch).sum())
            del scratch, ref
            self.cos_sum[layer] += float(cos.double().sum())
            self.cos_n[layer] += cos.numel()

        return (observe,)

    def summary(self) -> list[dict]:
        rows = []
        for i in range(len(self.err2)):
            def snr(key: str) -> float:
                n = self.noise[key][i]
                return math.inf if n == 0 else 10 * math.log10(self.sig[key][i] / n) if self.sig[key][i] > 0 else math.nan

            rows.append(
                {
                    "layer": i,
                    "attn_rel_l2": math.sqrt(self.err2[i] / self.ref2[i]) if self.ref2[i] else math.nan,
                    "attn_cosine": self.cos_sum[i] / self.cos_n[i] if self.cos_n[i] else math.nan,
                    "latent_snr_db": snr("latent"),
                    "rope_snr_db": snr("rope"),
                }
            )
        return rows
