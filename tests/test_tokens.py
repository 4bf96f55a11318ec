"""GPT-2 tokens from the packaged vocabulary: known ids, round trips, the hash check, parity with tiktoken."""

import hashlib

import pytest

from lab import tokens

TEXTS = [
    "Hello world",
    "def f(x):\n    return x ** 2  # squares\n\n\n",
    "naïve café, 東京, emoji 🙂 and trailing spaces   ",
    "It's 2024; they'll've done it.",
    "",
]


def test_known_ids():
    assert tokens.encode("Hello world") == [15496, 995]
    assert tokens.encode(" the") == [262]
    assert tokens.encode("<|endoftext|>", allow_endoftext=True) == [tokens.EOT] == [50256]
    assert tokens.encoding().n_vocab == tokens.VOCAB_SIZE == 50257


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(text):
    ids = tokens.encode(text)
    assert all(0 <= i < tokens.EOT for i in ids)
    assert tokens.decode(ids) == text


def test_endoftext_in_text_is_refused_unless_allowed():
    with pytest.raises(ValueError, match="special token"):
        tokens.encode("a<|endoftext|>b")
    assert tokens.encode("a<|endoftext|>b", allow_endoftext=True)[1] == tokens.EOT


def test_text_pieces_hold_back_split_characters():
    text = "東京 🙂 ok"
    ids = tokens.encode(text)
    pieces = list(tokens.text_pieces(ids))
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # at least one token ends inside a character here, so a naive per-token decode would break it
    assert any("\ufffd" in tokens.decode([i]) for i in ids)


def test_file_hash_checked(tmp_path):
    data = tokens.VOCAB_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == tokens.VOCAB_SHA256
    damaged = tmp_path / "gpt2.tiktoken"
    damaged.write_bytes(data.replace(b"IQ== 0", b"Ig== 0", 1))
    with pytest.raises(ValueError, match="sha256 .* does not match"):
        tokens.load_encoding(damaged)


def test_equals_tiktoken_gpt2_when_downloadable():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        reference = tiktoken.get_encoding("gpt2")
    except Exception as error:  # no network and no tiktoken cache: nothing to compare against
        pytest.skip(f"tiktoken's gpt2 cannot be loaded here: {type(error).__name__}")
    for text in TEXTS:
        assert tokens.encode(text) == reference.encode(text)
    assert tokens.encoding()._mergeable_ranks == reference._mergeable_ranks


def test_hugging_face_tokenizer_from_the_packaged_ranks_matches(tmp_path):
    import transformers  # a dev dependency: the tools that read this directory load it with it

    directory = tokens.write_hf_tokenizer(tmp_path / "gpt2")
    hf = transformers.GPT2TokenizerFast.from_pretrained(directory)
    texts = [
        "Hello world, it's 2026!  Tabs\tand\nnewlines\n\n  def main(argv):\n    return 0",
        "naïve café, 東京, emoji 🙂 and a lone é; 'll 've 're 12345678",
        "<|endoftext|>text after the separator",
    ]
    for text in texts:
        assert hf.encode(text) == tokens.encode(text, allow_endoftext=True)
        assert hf.decode(tokens.encode(text, allow_endoftext=True)) == text
    assert hf.eos_token_id == tokens.EOT and len(hf) == tokens.VOCAB_SIZE
