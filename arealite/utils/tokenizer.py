"""Fast ``tokenizer.decode`` for the rollout hot path.

Every sample is decoded once (for its reward), on the event loop thread.
transformers' ``decode`` walks the ids in Python before handing them to Rust,
which costs more than the decoding itself; ``decode`` here gives the same text
through a per-id byte table (byte-level BPE vocabularies, checked against the
tokenizer on the whole vocabulary when built) or the Rust tokenizer directly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("arealite.utils.tokenizer")


def _byte_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in set(keep))
    out = {chr(b): b for b in keep}
    out.update((chr(256 + i), b) for i, b in enumerate(extra))
    return out


class _ByteLevelTable:
    """Decodes ids of a byte-level BPE tokenizer by table lookup, in Python.

    The Rust ``decode`` spends most of its time per token on the way in and
    back out; for a few hundred ids a join of per-id bytes is ~3x cheaper.
    Built only for a ``ByteLevel`` decoder, checked against the Rust decode on
    the whole vocabulary; ids it does not know go to Rust. Invalid UTF-8 (a
    sequence cut inside a character) becomes U+FFFD per maximal invalid
    subpart in both Python's ``errors="replace"`` and Rust's ``from_utf8_lossy``.
    """

    def __init__(self, backend: Tokenizer):
        chars = _byte_chars()
        vocab = backend.get_vocab(with_added_tokens=True)
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        full: dict[int, bytes] = {}
        for tok, i in vocab.items():
            try:  # as the Rust decoder: map every char, or keep the token's UTF-8 if one is not in the alphabet
                full[i] = bytes(chars[c] for c in tok)
            except KeyError:
                full[i] = tok.encode()
        self.full = full
        self.plain = {i: (b"" if i in special else b) for i, b in full.items()}
        ids = sorted(full)
        for skip in (False, True):  # refuse to exist if it disagrees with Rust anywhere
            for a in range(0, len(ids), 4096):
                chunk = ids[a:a + 4096]
                ours = b"".join(map((self.plain if skip else full).__getitem__, chunk)).decode("utf-8", "replace")
                if ours != backend.decode(chunk, skip_special_tokens=skip):
                    raise ValueError("byte-level table disagrees with the tokenizer's decode")

    def __call__(self, ids: Iterable[int], skip_special_tokens: bool) -> str:
        # KeyError (unknown or negative id) propagates: the caller falls back to Rust.
        return b"".join(map((self.plain if skip_special_tokens else self.full).__getitem__, ids)).decode(
            "utf-8", "replace")


# tokenizer id -> (tokenizer, table or None). Holding the tokenizer keeps its id from being reused.
_TABLES: dict[int, tuple[PreTrainedTokenizerBase, _ByteLevelTable | None]] = {}


def _table(tokenizer: PreTrainedTokenizerBase, backend: Tokenizer) -> _ByteLevelTable | None:
    entry = _TABLES.get(id(tokenizer))
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    table = None
    if type(getattr(backend, "decoder", None)).__name__ == "ByteLevel":
        try:
            table = _ByteLevelTable(backend)
        except Exception as e:  # an unusual vocabulary: Rust decodes it, as before
            logger.debug("no byte-level decode table for %s: %s", type(tokenizer).__name__, e)
    _TABLES[id(tokenizer)] = (tokenizer, table)
    return table


def _rust(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    # The Rust tokenizer gives the same text as transformers' decode unless that cleans up spaces.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


def prepare_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    """Build ``decode``'s lookup table now (a workflow's constructor), not on the event loop later."""
    backend = _rust(tokenizer)
    if backend is not None:
        _table(tokenizer, backend)


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = True) -> str:
    """``tokenizer.decode``, through a lookup table or the Rust tokenizer when that gives the same text.

    transformers' ``decode`` walks the id list in Python first, which costs more
    than the decoding itself on the hot path of every sample.
    """
    backend = _rust(tokenizer)
    if backend is None:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    table = _table(tokenizer, backend)
    if table is not None:
        try:
            return table(ids, skip_special_tokens)
        except (KeyError, TypeError):
            pass
    return backend.decode(ids, skip_special_tokens=skip_special_tokens)


def decode_many(tokenizer: PreTrainedTokenizerBase, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """``decode`` of several sequences.

    One by one, not with the Rust ``decode_batch``: that releases the GIL and
    must win it back, which on a busy event loop thread can cost a whole GIL
    switch interval (5 ms) per call.
    """
    return [decode(tokenizer, s, skip_special_tokens) for s in seqs]


def vocab_bound(model_path: str, tokenizer: PreTrainedTokenizerBase) -> int:
    """One above the largest token id the model at ``model_path`` can emit: its embedding rows
    (``config.vocab_size``, often padded beyond the tokenizer), or the tokenizer's size if larger."""
    from transformers import AutoConfig

    n = len(tokenizer)
    try:
        cfg = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        logger.warning("cannot read the model config at %s (%s); output ids are checked against "
                       "the tokenizer's %d tokens", model_path, e, n)
        return n
    text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    return max(n, int(getattr(text_cfg, "vocab_size", 0) or 0))
