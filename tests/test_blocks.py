"""Block-set specs: the grammar, validation against the depth, and round trips through str()."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.blocks import BlockSet

N_LAYER = 12


@pytest.mark.parametrize(
    "spec, skip, exit_at",
    [
        ("all", set(), None),
        ("skip=3,4", {3, 4}, None),
        ("keep=0,1,2", set(range(3, 12)), None),
        ("exit=6", set(), 6),
        ("skip=5;exit=9", {5}, 9),
        (" skip = 5 , 6 ; exit = 9 ", {5, 6}, 9),  # spaces around parts, keys, values and indices
        ("skip=05", {5}, None),
    ],
)
def test_parse(spec, skip, exit_at):
    block_set = BlockSet.parse(spec, N_LAYER)
    assert block_set.skip == skip
    assert block_set.exit_at == exit_at
    assert BlockSet.parse(str(block_set), N_LAYER) == block_set


def test_blocks_to_run():
    assert BlockSet.parse("skip=1;exit=4", 12).blocks_to_run(12) == [0, 2, 3]
    assert BlockSet().blocks_to_run(3) == [0, 1, 2]


@pytest.mark.parametrize(
    "spec, message",
    [
        # the grammar
        ("", "'': empty spec"),
        ("keep=", "'keep=': keep needs a value"),
        ("skip=", "'skip=': skip needs a value"),
        ("skip=1,,2", "'skip=1,,2': empty index in skip"),
        ("skip=1,", "'skip=1,': empty index in skip"),
        ("skip=1 2", "'skip=1 2': '1 2' is not a block index"),
        ("overwrite=x", "'overwrite=x': 'x' is not a block index"),
        ("exit=1_2", "'exit=1_2': exit takes a whole number in ASCII digits"),
        ("exit=+6", "'exit=+6': exit takes a whole number"),
        ("exit=\uff16", "'exit=\uff16': exit takes a whole number"),  # full-width 6
        ("exit=\u0666", "'exit=\u0666': exit takes a whole number"),  # Arabic-Indic 6
        ("skip=\u0663", "is not a block index"),
        ("min=-1;adaptive=0.9", "'min=-1': min takes a whole number"),
        ("adaptive=nan", "'adaptive=nan': adaptive takes a decimal number"),
        ("adaptive=0.9_1", "'adaptive=0.9_1': adaptive takes a decimal number"),
        ("adaptive=\uff10.5", "adaptive takes a decimal number"),
        ("adaptive=0.9;check=Probe", "'check=Probe': check is 'cosine' or 'probe'"),
        ("skip=1;skip=2", "'skip=2': skip given twice"),
        ("exit=3;exit=3", "'exit=3': exit given twice"),
        ("min=2", "'min=2': only with adaptive"),
        ("min=1", "'min=1': only with adaptive"),
        ("check=probe", "'check=probe': only with adaptive"),
        ("check=cosine;exit=3", "'check=cosine': only with adaptive"),
        ("skip=1;", "'skip=1;': empty part"),
        (";skip=1", "empty part"),
        ("all;skip=1", "'all' stands alone"),
        ("skip", "'skip': expected key=value"),
        ("jump=3", "'jump=3': unknown key 'jump'"),
        ("skip=1;keep=2", "'keep=2': cannot be combined with skip"),
        # the rules of the fields, against the depth
        ("skip=12", "'skip=12': block indices [12] out of range 0..11"),
        ("skip=3,3", "'skip=3,3': duplicated block index 3 in skip"),
        ("keep=0,0", "'keep=0,0': duplicated block index 0 in keep"),
        ("exit=13", "'exit=13': must be in 1..12"),
        ("exit=0", "'exit=0': must be in 1..12"),
        ("overwrite=2;skip=2", "'overwrite=2': blocks [2] are also skipped"),
        ("adaptive=1.5", "'adaptive=1.5': must be in (0, 1]"),
        ("adaptive=0", "'adaptive=0': must be in (0, 1]"),
        ("adaptive=0.9;exit=3", "'exit=3': cannot be combined with adaptive exit"),
        ("adaptive=0.9;min=20", "'min=20': must be in 1..12"),
        # min counts the blocks the set runs, not the model's (issue #20: 11 of 12 skipped, min=2)
        ("keep=11;adaptive=0.5;min=2", "'min=2': must be at most the 1 blocks the set runs"),
        ("keep=0,5,6;adaptive=0.9;min=4", "'min=4': must be at most the 3 blocks the set runs"),
        ("skip=0,1,2,3,4,5,6,7,8,9,10,11;adaptive=0.9", "'adaptive=0.9': needs at least one block to run"),
    ],
)
def test_malformed_specs_name_the_part(spec, message):
    with pytest.raises(ValueError) as error:
        BlockSet.parse(spec, N_LAYER)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_the_fields_follow_the_same_rules():
    with pytest.raises(ValueError, match="keep: needs at least one block"):
        BlockSet.keep([], N_LAYER)
    with pytest.raises(ValueError, match="adaptive_min_blocks: only with adaptive"):
        BlockSet(adaptive_min_blocks=3).validate(N_LAYER)
    with pytest.raises(ValueError, match="adaptive_check: only with adaptive"):
        BlockSet(adaptive_check="probe").validate(N_LAYER)


def test_what_a_set_cannot_serve_comes_from_the_table():
    assert BlockSet.parse("adaptive=0.9", N_LAYER).cannot_serve("top_tokens") == (
        "not with adaptive (its scoring pass gives each position's loss, not its most likely token)"
    )
    assert BlockSet.parse("speculate=6", N_LAYER).cannot_serve("min_tokens").startswith("not with speculate")
    for spec in ("all", "skip=3", "exit=6", "speculate=6;k=2"):
        assert BlockSet.parse(spec, N_LAYER).cannot_serve("top_tokens") is None
    assert BlockSet.parse("adaptive=0.9;min=12", N_LAYER).adaptive_min_blocks == 12  # all 12 run


def test_adaptive_round_trip():
    block_set = BlockSet.parse("adaptive=0.9;min=4;check=probe", 12)
    assert block_set.is_adaptive and block_set.adaptive_min_blocks == 4
    assert block_set.adaptive_check == "probe"
    assert str(block_set) == "adaptive=0.9;min=4;check=probe"
    # defaults are left out of the canonical form
    assert str(BlockSet.parse("adaptive=.5;min=1;check=cosine", 12)) == "adaptive=0.5"


def test_lens_round_trip():
    """lens=tuned goes with an exit, adaptive exit and speculation's drafts; logit, the default, is
    left out of the canonical form; the value is one of the two."""
    for spec in ["exit=6;lens=tuned", "adaptive=0.9;min=4;lens=tuned", "speculate=6;k=3;lens=tuned"]:
        block_set = BlockSet.parse(spec, 12)
        assert block_set.lens == "tuned" and str(block_set) == spec
    assert str(BlockSet.parse("lens = tuned ; exit = 6", 12)) == "exit=6;lens=tuned"
    assert BlockSet.parse("exit=6;lens=logit", 12) == BlockSet(exit_at=6)
    assert BlockSet.parse("speculate=6;lens=tuned", 12).without_speculation() == BlockSet()
    with pytest.raises(ValueError, match="'lens=tune': lens is 'logit' or 'tuned', got 'tune'"):
        BlockSet.parse("exit=6;lens=tune", 12)


INDICES = st.sets(st.integers(0, N_LAYER - 1), max_size=N_LAYER)


@st.composite
def valid_block_sets(draw) -> BlockSet:
    """A BlockSet from valid field values (any n_layer-block model accepts it)."""
    skip = draw(INDICES)
    overwrite = draw(INDICES) - skip
    lens = draw(st.sampled_from(["logit", "tuned"]))
    runs = N_LAYER - len(skip)
    if runs and draw(st.booleans()):  # adaptive needs a block to run, and min at most the blocks it runs
        threshold = draw(st.floats(0.0, 1.0, exclude_min=True))
        return BlockSet(
            skip=skip,
            overwrite=overwrite,
            adaptive_threshold=threshold,
            adaptive_min_blocks=draw(st.integers(1, runs)),
            adaptive_check=draw(st.sampled_from(["cosine", "probe"])),
            lens=lens,
        )
    exit_at = draw(st.none() | st.integers(1, N_LAYER))
    return BlockSet(skip=skip, overwrite=overwrite, exit_at=exit_at, lens=lens)


@given(block_set=valid_block_sets())
@settings(max_examples=300, deadline=None)
def test_every_valid_block_set_round_trips_through_str(block_set):
    block_set.validate(N_LAYER)
    assert BlockSet.parse(str(block_set), N_LAYER) == block_set


SPACES = st.sampled_from(["", "", " ", "  "])


@st.composite
def spec_strings(draw) -> str:
    """Spec strings near the grammar: each part usually well formed, sometimes not, with spaces."""
    good = st.integers(0, N_LAYER - 1).map(str)
    index = good | good | good | st.sampled_from(["", "03", "+1", "1_0", "\uff13", "x", str(N_LAYER)])
    number = st.floats(0.0, 1.0).map(repr) | st.sampled_from([".5", "1e-3", "1.", "1.5", "nan", "inf", ""])
    values = {
        "skip": st.lists(index, max_size=3).map(",".join),
        "keep": st.lists(index, max_size=3).map(",".join),
        "overwrite": st.lists(index, max_size=3).map(",".join),
        "exit": index,
        "adaptive": number,
        "min": index,
        "check": st.sampled_from(["cosine", "probe", "", "cos"]),
        "lens": st.sampled_from(["logit", "tuned", "", "Tuned"]),
    }
    keys = draw(st.lists(st.sampled_from(sorted(values)), min_size=1, max_size=3, unique=draw(st.booleans())))
    pad = lambda text: draw(SPACES) + text + draw(SPACES)  # noqa: E731
    return ";".join(pad(pad(key) + "=" + pad(draw(values[key]))) for key in keys)


@given(spec=spec_strings())
@settings(max_examples=500, deadline=None)
def test_every_accepted_spec_round_trips(spec):
    try:
        block_set = BlockSet.parse(spec, N_LAYER)
    except ValueError:
        return  # refused: the table above checks what the message says
    assert BlockSet.parse(str(block_set), N_LAYER) == block_set
    assert " " not in str(block_set)


@given(spec=st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_any_text_parses_or_raises_value_error(spec):
    try:
        BlockSet.parse(spec, N_LAYER)
    except ValueError as error:
        assert "\n" not in str(error)  # the part is quoted with repr: one line, whatever was typed


@pytest.mark.parametrize("spec", ["skip=1,,2", "exit=+6", "exit=\u0666", "skip=1;skip=2", "min=2", "keep="])
def test_the_server_refuses_the_same_specs_naming_the_part(spec):
    from serve.schema import PredictRequest, RequestError, resolve_block_set

    with pytest.raises(RequestError) as error:
        resolve_block_set(PredictRequest(prompt="a", blocks=spec), N_LAYER)
    assert error.value.field == "blocks"
    assert error.value.message.startswith(f"{spec.split(';')[-1]!r}: ")


def test_the_server_refuses_an_empty_keep_list():
    from serve.schema import PredictRequest, RequestError, resolve_block_set

    with pytest.raises(RequestError, match="keep: needs at least one block"):
        resolve_block_set(PredictRequest(prompt="a", keep=[]), N_LAYER)


def test_errors_carry_the_key_at_fault():
    from lab.blocks import KEYS, BlockSetError

    cases = [
        ("skip=1;exit=20", "exit", "'exit=20': must be in 1..12, got 20"),
        ("adaptive=0.9;min=0", "min", "'min=0': must be in 1..12, got 0"),
        ("min=2", "min", "'min=2': only with adaptive=THRESHOLD"),
        ("speculate=2;k=17", "k", "'k=17': must be in 1..16, got 17"),
    ]
    for spec, key, message in cases:
        with pytest.raises(BlockSetError) as error:
            BlockSet.parse(spec, N_LAYER)
        assert error.value.key is KEYS[key] and str(error.value) == message
    with pytest.raises(BlockSetError) as error:
        BlockSet(exit_at=13).validate(N_LAYER)  # a set made in code names its field
    assert error.value.key is KEYS["exit"] and str(error.value) == "exit_at: must be in 1..12, got 13"
    assert BlockSet().draft_tokens == KEYS["k"].default and str(BlockSet(speculate=3)) == "speculate=3"


def test_the_request_fields_come_from_the_table():
    from lab.blocks import KEYS
    from serve.schema import PredictRequest, RequestError, resolve_block_set

    named = {key.request: key for key in KEYS.values() if key.request is not None}
    assert set(named) == {
        "skip",
        "keep",
        "overwrite",
        "exit_at",
        "adaptive",
        "adaptive_min_blocks",
        "adaptive_check",
        "lens",
    }
    schema = PredictRequest.model_json_schema()["properties"]
    assert set(named) <= set(schema)
    assert schema["adaptive_check"]["anyOf"][0]["enum"] == ["cosine", "probe"]
    assert schema["lens"]["anyOf"][0]["enum"] == ["logit", "tuned"]
    assert schema["exit_at"]["anyOf"][0]["minimum"] == 1
    for field, value, reason in [("exit_at", 13, "must be in 1..12"), ("adaptive", 0.5, None)]:
        request = PredictRequest(prompt="a", **{field: value})
        if reason is None:
            assert resolve_block_set(request, N_LAYER) == BlockSet(adaptive_threshold=0.5)
            continue
        with pytest.raises(RequestError) as error:
            resolve_block_set(request, N_LAYER)
        assert error.value.field == field and error.value.message.startswith(reason)
