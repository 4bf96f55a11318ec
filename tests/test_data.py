import math
from types import SimpleNamespace

import pytest
import torch

from lab.data import CharDataModule, DataError, RandomWindows, entropies


def ids_of(text: str) -> tuple[torch.Tensor, int]:
    vocab = sorted(set(text))
    return torch.tensor([vocab.index(ch) for ch in text]), len(vocab)


def write(tmp_path, name: str, content: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(content)
    return str(path)


def test_entropies_of_hand_made_texts():
    unigram, bigram = entropies(*ids_of("ab" * 500))
    assert unigram == pytest.approx(math.log(2))
    assert bigram == pytest.approx(0.0, abs=1e-9)  # the previous character decides the next

    # "aaab" repeated: after "b" always "a"; after "a", "a" 2/3 and "b" 1/3 of the time.
    unigram, bigram = entropies(*ids_of("aaab" * 1000))
    assert unigram == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    after_a = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert bigram == pytest.approx(0.75 * after_a, rel=1e-3)


def test_batches_are_windows_with_targets_shifted_by_one(tmp_path):
    text = "".join(chr(ord("a") + i % 26) for i in range(3000))
    dm = CharDataModule(paths=[write(tmp_path, "abc.txt", text.encode())], seq_len=16, batch_size=4)
    assert dm.vocab == "abcdefghijklmnopqrstuvwxyz"
    assert len(dm.train_ids) == 2700 and len(dm.val_ids) == 300  # the last 10% held out
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y, strict=True):
        window = dm.decode(row_x) + dm.decode(row_y[-1:])
        assert window in text
    val = list(dm.val_dataloader())
    assert len(val) == dm.val_batches
    assert all(dm.decode(vx[0]) in text[2700:] for vx, _ in val)


def test_training_order_is_a_function_of_seed_and_step():
    ids = torch.arange(1000) % 50
    same = RandomWindows(ids, 8, 4, seed=1)
    assert torch.equal(same[7][0], RandomWindows(ids, 8, 4, seed=1)[7][0])
    assert not torch.equal(same[7][0], same[8][0])
    assert not torch.equal(same[7][0], RandomWindows(ids, 8, 4, seed=2)[7][0])


def test_loader_starts_at_the_trainers_step_and_splits_ranks(tmp_path):
    dm = CharDataModule(paths=[write(tmp_path, "t.txt", ("hello world " * 200).encode())], seq_len=8)
    windows = RandomWindows(dm.train_ids, 8, dm.batch_size, dm.seed)
    dm.trainer = SimpleNamespace(global_step=5, accumulate_grad_batches=2, global_rank=0, world_size=1)
    first = next(iter(dm.train_dataloader()))
    assert torch.equal(first[0], windows[10][0])  # 5 steps of 2 micro-batches were consumed
    dm.trainer = SimpleNamespace(global_step=3, accumulate_grad_batches=1, global_rank=1, world_size=2)
    loader = iter(dm.train_dataloader())
    assert torch.equal(next(loader)[0], windows[7][0])  # rank 1 of 2 at step 3: 3*2+1
    assert torch.equal(next(loader)[0], windows[9][0])


def test_default_corpus_reference_lines():
    dm = CharDataModule()
    assert dm.vocab_size > 90
    assert dm.unigram_entropy == pytest.approx(3.25, abs=0.02)
    assert dm.bigram_entropy == pytest.approx(2.48, abs=0.02)
    assert dm.baselines == {"unigram": dm.unigram_entropy, "bigram": dm.bigram_entropy}


def test_vocabulary_travels_in_the_checkpoint_state(tmp_path):
    dm = CharDataModule(paths=[write(tmp_path, "t.txt", ("abc def " * 100).encode())], seq_len=8)
    state = dm.state_dict()
    assert state["vocab"] == " abcdef"
    dm.load_state_dict(state)
    other = CharDataModule(paths=[write(tmp_path, "u.txt", ("xyz " * 100).encode())], seq_len=8)
    with pytest.raises(DataError, match="different vocabulary"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("content", "settings", "message"),
    [
        (b"", {}, "is empty"),
        (b"caf\xe9 au lait " * 50, {}, "is not UTF-8 text"),
        (b"too short", {"seq_len": 64}, "fewer than one sequence of seq_len=64"),
    ],
)
def test_bad_data_names_the_problem(tmp_path, content, settings, message):
    path = write(tmp_path, "bad.txt", content)
    with pytest.raises(DataError, match=message) as err:
        CharDataModule(paths=[path], **settings)
    assert "\n" not in str(err.value)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(DataError, match="cannot read .*nowhere.txt"):
        CharDataModule(paths=[str(tmp_path / "nowhere.txt")])
