"""Saved reference log-probabilities (`kld --save-ref` / `--ref-file`).

Scoring a new format later then needs only that format's forwards. Two encodings:
- `topk` (default, k = 64): the k largest reference log-probs per token plus the observed token's
  and the argmax. KL is computed over the k tokens plus one "tail" bucket holding the remaining
  mass: sum_k p (log p - log q) + p_tail (log p_tail - log q_tail). By the log-sum inequality this
  is a lower bound of the full KL; the gap is the KL *inside* the tail, small when the tail mass
  is small (tests bound it on a real model).
- `fp16`: every log-prob as float16 (vocab x 2 bytes per token): the only error is fp16 rounding
  of the log-probs.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import torch

from mla_eval.errors import UserError

SCHEMA = "mla-eval/ref-logprobs/v1"


REF_STORE_MODES = ("topk", "fp16")

@dataclasses.dataclass
class RefStore:
    mode: str = "topk"
    k: int = 64
    meta: dict = dataclasses.field(default_factory=dict)
    rows: dict[str, list[torch.Tensor]] = dataclasses.field(default_factory=dict)
    _index: dict[int, int] | None = None
    _cat: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.mode not in REF_STORE_MODES:
            raise UserError(f"--ref-store {self.mode!r}: choose topk or fp16")

    def add(self, ref_logp: torch.Tensor, targets: torch.Tensor, order: torch.Tensor) -> None:
        ref_logp = ref_logp.float()
        part = {
            "order": order.cpu().long(),
            "target_logp": ref_logp.gather(1, targets.view(-1, 1).long()).squeeze(1).cpu(),
            "top1": ref_logp.argmax(-1).cpu().int(),
        }
        if self.mode == "topk":
            vals, idx = ref_logp.topk(min(self.k, ref_logp.shape[-1]), dim=-1)
            part["topk_logp"] = vals.cpu()
            part["topk_idx"] = idx.cpu().int()
        else:
            part["logp_fp16"] = ref_logp.half().cpu()
        for key, val in part.items():
            self.rows.setdefault(key, []).append(val)
        self._cat = None

    def _ensure_index(self) -> None:
        if self._cat is None:
            self._cat = {k: torch.cat(v) for k, v in self.rows.items()}
            self._index = {int(o): i for i, o in enumerate(self._cat["order"])}

    def lookup(self, order: torch.Tensor) -> dict[str, torch.Tensor]:
        self._ensure_index()
        try:
            rows = torch.tensor([self._index[int(o)] for o in order])
        except KeyError:
            raise UserError("the --ref-file holds no reference for some scored tokens; re-create it with --save-ref") from None
        return {k: v[rows] for k, v in self._cat.items()}

    def save(self, path: Path) -> None:
        self._ensure_index()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            torch.save({"schema": SCHEMA, "mode": self.mode, "k": self.k, "meta": self.meta, "rows": self._cat}, tmp)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, expect_meta: dict) -> "RefStore":
        if not Path(path).is_file():
            raise UserError(f"--ref-file {path} does not exist; create it with --save-ref")
        try:
            doc = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several types for a damaged file
            raise UserError(f"--ref-file {path} is not a reference file ({str(exc).splitlines()[0][:120]})") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise UserError(f"--ref-file {path} is not a {SCHEMA} file")
        # A key is written only when its setting is not the default (semantics, prefill, ref_scales), so a key on
        # either side alone is a difference too: an mha reference must not serve an absorbed run, nor the reverse.
        diff = [k for k in {**doc["meta"], **expect_meta} if doc["meta"].get(k) != expect_meta.get(k)]
        if diff:
            def shown(v):  # unset: that setting's default when the file was made (prefill: absorbed, semantics: cache)
                return "unset" if v is None else repr(v)

            pairs = ", ".join(f"{k}: file {shown(doc['meta'].get(k))} vs now {shown(expect_meta.get(k))}" for k in diff)
            raise UserError(
                f"--ref-file {path} was made with other settings ({pairs}); run with the file's settings or re-create it "
                "with --save-ref"
            )
        store = cls(mode=doc["mode"], k=doc["k"], meta=doc["meta"])
        store.rows = {k: [v] for k, v in doc["rows"].items()}
        return store


def metrics_from_store(ref: dict[str, torch.Tensor], fmt_logp: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same per-token metrics as `token_metrics`, with the reference taken from the store."""
    fmt_logp = fmt_logp.float()
    idx = targets.view(-1, 1).long()
    lf = fmt_logp.gather(1, idx).squeeze(1)
    lr = ref["target_logp"].to(fmt_logp.device)
    if "logp_fp16" in ref:
        ref_logp = ref["logp_fp16"].to(fmt_logp.device).float()
        kld = (ref_logp.exp() * (ref_logp - fmt_logp)).sum(-1)
        kld_rev = (fmt_logp.exp() * (fmt_logp - ref_logp)).sum(-1)
    else:  # both directions over the top k and one tail bin: lower bounds (merging outcomes never raises a KL)
        lp = ref["topk_logp"].to(fmt_logp.device)
        lq = fmt_logp.gather(1, ref["topk_idx"].to(fmt_logp.device).long())
        p, q = lp.exp(), lq.exp()
        tiny = torch.finfo(torch.float32).tiny
        p_tail = (1 - p.sum(-1)).clamp_min(tiny)
        q_tail = (1 - q.sum(-1)).clamp_min(tiny)
        kld = (p * (lp - lq)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
        kld_rev = (q * (lq - lp)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())
    return {
        "kld": kld.clamp_min(0.0).double(),
        "kld_rev": kld_rev.clamp_min(0.0).double(),
        "nll_ref": (-lr).double(),
        "nll_fmt": (-lf).double(),
        "p_ref": lr.exp().double(),
        "p_fmt": lf.exp().double(),
        "same_top1": (fmt_logp.argmax(-1).cpu().int() == ref["top1"]).double(),
    }
