"""Where evaluation tokens come from: a text file, a `datasets` name, or the model's own samples."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from mla_eval.errors import UserError
from mla_eval.protocol import option
from mla_eval.user_paths import TEXT_LIMIT, read_input_text

DATASET_ALIASES = {
    "wikitext-2": ("wikitext", "wikitext-2-raw-v1", "test"),
    "wikitext-103": ("wikitext", "wikitext-103-raw-v1", "test"),
}


@dataclasses.dataclass
class TokenSource:
    kind: str  # "text" | "dataset" | "self-samples"
    label: str  # what the output says the tokens are
    sequences: list[torch.Tensor]  # 1-D int64 token ids; windows never cross sequences
    digest: str  # sha256 of the tokens, ties a saved reference to its text

    @property
    def num_tokens(self) -> int:
        return sum(int(s.numel()) for s in self.sequences)


def _digest(seqs: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for s in seqs:
        h.update(s.to(torch.int64).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


# transformers warns once per tokenizer when a text is longer than the model's maximum ("will result in indexing
# errors"): we cut texts into windows ourselves, so the warning is noise. Marking it as already given silences just
# it (the key of PreTrainedTokenizerBase._eventual_warn_about_too_long_sequence, transformers 4.x and 5.x).
_TOO_LONG_WARNING = "sequence-length-is-longer-than-the-specified-maximum"


def quiet_long_text(tokenizer) -> None:
    """Silence transformers' one too-long-sequence warning on this tokenizer (windows are cut by mla-eval)."""
    flags = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(flags, dict):
        flags[_TOO_LONG_WARNING] = True


def _tokenize(tokenizer, text: str) -> torch.Tensor:
    quiet_long_text(tokenizer)
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)


def read_text_file(path: str | Path, option: str = "--text") -> str:
    """The file's text; refuses what is not a regular file of plain UTF-8 text (binary data would be scored
    as noise; a device or a pipe would be read without end)."""
    path = Path(path)
    text = read_input_text(path, option, TEXT_LIMIT)
    if "\x00" in text:
        raise UserError(f"{option} {path} holds NUL bytes (binary data?); give a plain-text file")
    if not text.strip():
        raise UserError(f"{option} {path} is empty")
    return text


def from_text_file(path: str | Path, tokenizer, max_tokens: int | None) -> TokenSource:
    path = Path(path)
    ids = _tokenize(tokenizer, read_text_file(path))
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return TokenSource("text", f"text file {path.name} ({ids.numel()} tokens)", [ids], _digest([ids]))


def from_dataset(name: str, tokenizer, max_tokens: int | None) -> TokenSource:
    try:
        import datasets  # imported only here: the GPU image and CPU installs may lack it
    except ImportError:
        raise UserError("--dataset needs the `datasets` package: pip install 'mla-eval[data]' (or use --text FILE)") from None
    repo, config, split = DATASET_ALIASES.get(name, (name, None, "test"))
    try:
        ds = datasets.load_dataset(repo, config, split=split)
    except Exception as exc:  # offline, unknown name, ...: datasets raises many types
        raise UserError(f"cannot load dataset {name!r} ({str(exc).splitlines()[0][:160]}); offline? use --text FILE") from None
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    text = "\n".join(t for t in ds[column] if t and t.strip())
    ids = _tokenize(tokenizer, text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return TokenSource("dataset", f"dataset {name} [{split}] ({ids.numel()} tokens)", [ids], _digest([ids]))


@torch.no_grad()
def self_samples(lm, num: int, length: int, seed: int, progress=None) -> TokenSource:
    """Seeded samples drawn from the model itself (bf16 cache, temperature 1).

    The data-free default: it needs no file, and its KLD is the format's effect on text the model
    finds typical. It is not comparable to a wikitext-2 number; outputs label it as such.
    Decoding runs through our own bf16 cache session: one new token per step per sequence.
    """
    from mla_eval.formats import get_format
    from mla_eval.model.session import CacheSession

    if num < 1 or length < 2:
        raise UserError("self-samples need --samples >= 1 and --sample-len >= 2")
    if length > lm.max_positions > 0:  # as --ctx is: refused before the sampling, not hours into it
        raise UserError(f"--sample-len {length} is beyond the model's {lm.max_positions} positions; lower --sample-len")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    model = lm.model
    bos = lm.tokenizer.bos_token_id
    vocab = model.config.vocab_size
    first = torch.full((num,), bos, dtype=torch.int64) if bos is not None else torch.randint(0, vocab, (num,), generator=gen)
    if getattr(lm.adapter, "is_v4", False):  # DeepSeek-V4: drawn through the model's own cache (its sessions are whole
        from mla_eval.model.deepseek_v4 import sample_tokens  # windows only)

        seqs = list(sample_tokens(lm, first, length, gen, progress))
        return TokenSource("self-samples", f"self-samples of the model (seed {seed}, {num} x {length} tokens, drawn "
                           "through its own transformers cache; not wikitext)", seqs, _digest(seqs))
    ids = torch.empty(num, length, dtype=torch.int64)
    ids[:, 0] = first
    session = CacheSession(get_format("bf16"), lm.num_layers, num, length, lm.layer_devices)
    with lm.adapter.session(session):
        for t in range(length - 1):
            step = ids[:, t : t + 1].to(lm.device)
            logits = model(input_ids=step, position_ids=torch.full((num, 1), t, device=lm.device), use_cache=False).logits[:, -1]
            ids[:, t + 1] = torch.multinomial(logits.float().softmax(-1).cpu(), 1, generator=gen).squeeze(1)
            if progress is not None:
                progress("sample", t + 1, length - 1)
    seqs = list(ids)
    return TokenSource(
        "self-samples", f"self-samples of the model (seed {seed}, {num} x {length} tokens; not wikitext)", seqs, _digest(seqs)
    )


def self_samples_subset(source: TokenSource, n: int) -> TokenSource:
    """The first n sequences of a self-samples source (the rest serve another purpose)."""
    seqs = source.sequences[:n]
    label = source.label.replace(f"{len(source.sequences)} x", f"{n} x")
    return TokenSource(source.kind, label, seqs, _digest(seqs))


@dataclasses.dataclass(frozen=True)
class TextSettings:
    """Where the tokens come from: a text file, a `datasets` name, or (neither) seeded self-samples."""

    text: Path | None = option(None, "--text", help="Plain-text (UTF-8) file to evaluate on.", path="read")
    dataset: str | None = option(
        None, "--dataset", help="A `datasets` name (wikitext-2 = wikitext-2-raw-v1 test); needs the data extra."
    )
    max_tokens: int | None = option(None, "--max-tokens", help="Use at most this many tokens of the text (default: all).")
    samples: int = option(4, "--samples", help="Self-samples (no --text/--dataset): number of sequences.")
    sample_len: int = option(256, "--sample-len", help="Self-samples: tokens per sequence.")
    seed: int = option(0, "--seed", help="Seed of the self-samples.")
    text_note: str | None = option(  # recorded in the result's text.note
        None, "--text-note", help="How the --text file was built (recorded in the result's text.note), e.g. which articles."
    )

    def __post_init__(self) -> None:
        if self.text is not None and self.dataset is not None:
            raise UserError("give either --text or --dataset, not both")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"--max-tokens must be at least 1 (omit it to use all of the text), got {self.max_tokens}")
        if self.text is not None:
            read_text_file(self.text)  # a missing or binary file fails before any model loads
        if self.samples < 1 or self.sample_len < 2:
            raise UserError(f"self-samples need --samples >= 1 and --sample-len >= 2, got {self.samples} and {self.sample_len}")

    @property
    def self_samples(self) -> bool:
        return self.text is None and self.dataset is None


def load_source(lm, st: TextSettings, progress=None) -> TokenSource:
    if st.text is not None:
        return from_text_file(st.text, lm.tokenizer, st.max_tokens)
    if st.dataset is not None:
        return from_dataset(st.dataset, lm.tokenizer, st.max_tokens)
    return self_samples(lm, st.samples, st.sample_len, st.seed, progress)
