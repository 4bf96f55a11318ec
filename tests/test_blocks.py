"""Block-set specs: parsing, validation against the depth, and round trips."""

import pytest

from lab.blocks import BlockSet


@pytest.mark.parametrize(
    "spec, skip, exit_at",
    [
        ("all", set(), None),
        ("skip=3,4", {3, 4}, None),
        ("keep=0,1,2", set(range(3, 12)), None),
        ("exit=6", set(), 6),
        ("skip=5;exit=9", {5}, 9),
    ],
)
def test_parse(spec, skip, exit_at):
    block_set = BlockSet.parse(spec, n_layer=12)
    assert block_set.skip == skip
    assert block_set.exit_at == exit_at
    assert BlockSet.parse(str(block_set), n_layer=12) == block_set


def test_blocks_to_run():
    assert BlockSet.parse("skip=1;exit=4", 12).blocks_to_run(12) == [0, 2, 3]
    assert BlockSet().blocks_to_run(3) == [0, 1, 2]


@pytest.mark.parametrize(
    "spec, field",
    [
        ("skip=12", "skip"),
        ("skip=-1", "skip"),
        ("skip=3,3", "skip"),
        ("keep=0,0", "keep"),
        ("exit=13", "exit_at"),
        ("exit=0", "exit_at"),
        ("exit=x", "exit_at"),
        ("overwrite=2;skip=2", "overwrite"),
        ("adaptive=1.5", "adaptive_threshold"),
        ("adaptive=0.9;exit=3", "exit_at"),
        ("adaptive=0.9;min=20", "adaptive_min_blocks"),
        ("skip=1;keep=2", "skip or keep"),
        ("jump=3", "unknown key"),
        ("skip", "key=value"),
    ],
)
def test_invalid_specs_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        BlockSet.parse(spec, n_layer=12)


def test_adaptive_round_trip():
    block_set = BlockSet.parse("adaptive=0.9;min=4", 12)
    assert block_set.is_adaptive and block_set.adaptive_min_blocks == 4
    assert str(block_set) == "adaptive=0.9;min=4"
