"""GPT-2's byte-pair encoding, built from the vocabulary file inside this package (works offline).

    from lab import tokens
    ids = tokens.encode("Hello world")  # [15496, 995]
    tokens.decode(ids)                  # "Hello world"

The file ``lab/assets/gpt2.tiktoken`` is tiktoken's ``r50k_base`` ranks, the same 50256 merges as
``tiktoken.get_encoding("gpt2")``; its sha256 is checked on load so a damaged copy fails loudly
instead of tokenising differently.

Tools that take a Hugging Face tokenizer (aiperf, lm-eval) get one derived offline from the same
ranks: ``blocklab tokenizer --out DIR`` (``write_hf_tokenizer``).
"""

from __future__ import annotations

import base64
import codecs
import functools
import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from importlib import resources
from pathlib import Path

import tiktoken

VOCAB_FILE = Path(str(resources.files("lab") / "assets" / "gpt2.tiktoken"))
VOCAB_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
ENDOFTEXT = "<|endoftext|>"
EOT = 50256
"""The id of ``<|endoftext|>``: GPT-2's document separator, and the token generation stops at."""
VOCAB_SIZE = 50257

# r50k_base's pre-tokeniser, copied from tiktoken_ext/openai_public.py (equivalent to GPT-2's
# original pattern, faster): contractions, letters, digits, other symbols, whitespace.
PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def load_encoding(path: str | Path = VOCAB_FILE, expected_sha256: str = VOCAB_SHA256) -> tiktoken.Encoding:
    """Build the GPT-2 encoding from a ``.tiktoken`` ranks file, after checking its sha256."""
    data = Path(path).read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected_sha256:
        raise ValueError(
            f"{path}: sha256 {actual} does not match the GPT-2 vocabulary's {expected_sha256}; "
            "the file is damaged or not GPT-2's (reinstall blocklab)"
        )
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )


@functools.cache
def encoding() -> tiktoken.Encoding:
    """The packaged GPT-2 encoding, built once per process."""
    return load_encoding()


def encode(text: str, *, allow_endoftext: bool = False) -> list[int]:
    """Token ids of ``text``. ``<|endoftext|>`` in the text is an error unless allowed (then it is 50256)."""
    allowed = {ENDOFTEXT} if allow_endoftext else set()
    return encoding().encode(text, allowed_special=allowed)


def decode(ids: list[int]) -> str:
    """The text of token ids; bytes that do not form valid UTF-8 become U+FFFD."""
    return encoding().decode(ids)


def decode_token_bytes(token: int) -> bytes:
    """The raw bytes of one token (a token may hold part of a UTF-8 character)."""
    return encoding().decode_single_token_bytes(token)


def text_pieces(ids: Iterable[int]) -> Iterator[str]:
    """Decode a stream of tokens piece by piece, holding back bytes of a UTF-8 character not yet complete.

    Joining the pieces gives ``decode(ids)``; each piece is emitted as soon as its characters are whole,
    which is what a streaming response needs (a token may end in the middle of a character).
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in ids:
        piece = decoder.decode(decode_token_bytes(token))
        if piece:
            yield piece
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def char_offsets(ids: Iterable[int]) -> list[int]:
    """Where each token's text begins, in characters of the tokens' text decoded piece by piece (as
    ``text_pieces``): a token that ends mid-character begins where the next one does."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, offset = [], 0
    for token in ids:
        offsets.append(offset)
        offset += len(decoder.decode(decode_token_bytes(token)))
    return offsets


# --------------------------------------------------------------------------------------------------
# A Hugging Face tokenizer directory, derived from the ranks


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, which Hugging Face's vocab.json and merges.txt use:
    printable Latin-1 bytes stand for themselves, the others for code points from 256 up."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = (byte for byte in range(256) if byte not in printable)
    mapping = {byte: chr(byte) for byte in printable}
    mapping.update({byte: chr(256 + n) for n, byte in enumerate(extra)})
    return mapping


def _parts(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """``token`` split as byte-pair merging builds it from merges of lower rank than its own: the
    lowest-ranked adjacent pair merges first, until only merges at or above the token's rank are left."""
    limit = ranks[token]
    parts = [bytes([byte]) for byte in token]
    while len(parts) > 1:
        found = [(ranks.get(a + b, limit), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
        rank, i = min(found)
        if rank >= limit:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts


def write_hf_tokenizer(directory: str | Path) -> Path:
    """Write GPT-2's tokenizer as Hugging Face reads it (vocab.json, merges.txt, tokenizer_config.json,
    config.json) into ``directory``, from the packaged ranks: no download. Returns the directory."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ranks = encoding()._mergeable_ranks  # tiktoken keeps the ranks it was built from only here
    show = byte_to_unicode()

    def text(piece: bytes) -> str:
        return "".join(show[byte] for byte in piece)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab[ENDOFTEXT] = EOT
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = _parts(ranks, token)
            if len(parts) != 2:
                raise ValueError(f"rank {ranks[token]}: {token!r} is not one merge of two tokens ({parts})")
            merges.append(f"{text(parts[0])} {text(parts[1])}")
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": 1024,
        "add_prefix_space": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return out


def tokenizer_command(out: Path) -> Path:
    """Write GPT-2's tokenizer as a Hugging Face directory (for aiperf, lm-eval), offline.

    Args:
        out: Directory to write vocab.json, merges.txt, tokenizer_config.json and config.json into.
    """
    return write_hf_tokenizer(out)


def main(argv: list[str]) -> int:
    """``blocklab tokenizer --out DIR``."""
    from lab import flags

    print(flags.run(tokenizer_command, argv[1:], "blocklab tokenizer"))
    return 0
