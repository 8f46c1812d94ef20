"""Per-layer error of a format, measured inside the same forward on the same activations.

- attention-output error: the latent-space attention output read from the quantised cache vs
  the output of exact float32 attention over the unquantised latents, for the same queries and
  the same keys (on DSA models, the top-k positions the layer's indexer chose: the reference is
  sparse too, so the error is the format's alone, not the sparsity's); relative L2 over all
  tokens and heads, and mean cosine per token-head;
- latent quantisation SNR: c_kv and k_pe vs what the cache actually stores (read back);
- on DSA models, top-k overlap: of the positions the reference run's indexer chose for a query at a layer, the
  share the format's run chose too (|A & B| / |A|), per layer and per query depth. The indexer reads the hidden
  state, so layer 0 agrees exactly and each later layer's top-k moves with the error earlier layers' caches put
  into the residual stream: the mechanism by which a small-latent layer's quantisation error loses a needle on a
  sparse model (b12x PR 86's GLM-5.2 report).
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


def chosen_mask(idx: torch.Tensor, valid: torch.Tensor, keys: int) -> torch.Tensor:
    """[..., keys] bool: the positions `idx` [..., k] names where `valid` (the others land in a spare slot, dropped)."""
    m = torch.zeros(*idx.shape[:-1], keys + 1, dtype=torch.bool, device=idx.device)
    m.scatter_(-1, torch.where(valid, idx, keys), True)
    return m[..., :keys]


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
            hidden = hidden | ~chosen_mask(idx, (idx >= 0) & (idx < s), s)
        scores.masked_fill_(hidden.unsqueeze(1), torch.finfo(torch.float32).min)
        out[:, a:e] = torch.einsum("bhts,bsc->bthc", scores.softmax(-1), kv[..., :512])
    return out


# Query-depth buckets of the top-k overlap: [0, 512), [512, 1K), [1K, 2K), ... (powers of two past 512)
TOPK_DEPTH_EDGES = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 1 << 40)


def topk_overlap(ref: torch.Tensor, got: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row of ref/got [B, T, k] (positions; -1 or a future position is no choice, as the cache reader
    treats it): (|A & B|, |A|) as float64 [B, T], A the reference's valid choices and B the format's."""
    b, t, _ = ref.shape
    pos = torch.arange(start, start + t, device=ref.device).view(1, t, 1)
    keys = start + t
    inter = torch.empty(b, t, dtype=torch.float64, device=ref.device)
    size = torch.empty_like(inter)
    rows = max(1, EXACT_BLOCK_BYTES // max(1, b * (keys + 1)))  # a [B, rows, keys] bool block at a time
    for a in range(0, t, rows):
        e = min(t, a + rows)
        masks = []
        for idx in (ref[:, a:e], got[:, a:e]):
            idx = idx.long()
            masks.append(chosen_mask(idx, (idx >= 0) & (idx <= pos[:, a:e]), keys))
        inter[:, a:e] = (masks[0] & masks[1]).sum(-1).double()
        size[:, a:e] = masks[0].sum(-1).double()
    return inter, size


class TopkRecorder:
    """The reference run's top-k per (forward key, layer), kept until the formats' runs of the same window batch
    have read it (one pass of the kld loop); an observer of the reference forward."""

    def __init__(self) -> None:
        self.sets: dict[tuple, torch.Tensor] = {}

    def observer(self, key: tuple):
        def observe(ev) -> None:
            if ev.topk is not None:
                self.sets[(key, ev.layer)] = ev.topk.to(torch.int32)

        return observe

    def lookup(self, key: tuple, layer: int) -> torch.Tensor | None:
        return self.sets.get((key, layer))


class LayerStats:
    def __init__(self, num_layers: int) -> None:
        self.err2 = [0.0] * num_layers
        self.ref2 = [0.0] * num_layers
        self.cos_sum = [0.0] * num_layers
        self.cos_n = [0] * num_layers
        self.sig = {"latent": [0.0] * num_layers, "rope": [0.0] * num_layers}
        self.noise = {"latent": [0.0] * num_layers, "rope": [0.0] * num_layers}
        buckets = len(TOPK_DEPTH_EDGES) - 1
        self.topk_inter = [[0.0] * buckets for _ in range(num_layers)]
        self.topk_size = [[0.0] * buckets for _ in range(num_layers)]

    def observers(self, spec: FormatSpec, ref_topk=None):
        """Observers of one format forward; `ref_topk(layer)` gives the reference run's top-k of the same window batch
        (DSA models), whose overlap with this run's is recorded."""
        def observe_topk(ev) -> None:
            ref = ref_topk(ev.layer) if ref_topk is not None and ev.topk is not None else None
            if ref is None:
                return
            start = ev.session.lengths[ev.layer] - ev.topk.shape[1]
            inter, size = topk_overlap(ref.to(ev.topk.device), ev.topk, start)
            depth = torch.arange(start, start + inter.shape[1], device=inter.device)
            bucket = torch.bucketize(depth, torch.tensor(TOPK_DEPTH_EDGES, device=depth.device), right=True) - 1
            nb = len(TOPK_DEPTH_EDGES) - 1
            sums = torch.zeros(2, nb, dtype=torch.float64, device=inter.device)
            sums[0].index_add_(0, bucket, inter.sum(0))
            sums[1].index_add_(0, bucket, size.sum(0))
            for i, (x, n) in enumerate(zip(*sums.tolist())):  # one copy to the host per layer
                self.topk_inter[ev.layer][i] += x
                self.topk_size[ev.layer][i] += n

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

        return (observe, observe_topk)

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
            if any(self.topk_size[i]):  # a DSA layer compared with the reference run's choices
                edges, inter, size = TOPK_DEPTH_EDGES, self.topk_inter[i], self.topk_size[i]
                rows[-1]["topk_overlap"] = sum(inter) / sum(size)
                rows[-1]["topk_overlap_by_depth"] = [
                    {"depth_lo": edges[j], "depth_hi": edges[j + 1], "overlap": inter[j] / size[j]}
                    for j in range(len(size)) if size[j]
                ]
        return rows
