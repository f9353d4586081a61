import pytest

from shared.lanes import (
    DEFAULT_LANES,
    LaneSpec,
    assign_lane,
    engine_groups,
    estimate_embed_tokens,
    estimate_generate_tokens,
)


@pytest.mark.parametrize(("tokens", "lane"), [(1, "short"), (128, "short"), (129, "medium"), (512, "medium"),
                                              (513, "long"), (10**6, "long")])
def test_default_lanes_by_tokens(tokens, lane):
    assert assign_lane(tokens, DEFAULT_LANES).name == lane


def test_last_lane_takes_everything_even_if_bounded():
    lanes = (LaneSpec("a", 10), LaneSpec("b", 20))
    assert assign_lane(21, lanes).name == "b"


def test_no_lanes_is_an_error():
    with pytest.raises(ValueError):
        assign_lane(1, ())


def test_generate_estimate_counts_prompt_and_output():
    assert estimate_generate_tokens({"input_ids": [1, 2, 3]}, 10) == (3, 13)
    prompt, total = estimate_generate_tokens({"prompt": "x" * 30}, 5)
    assert prompt == 11 and total == 16


def test_estimates_err_long_for_multibyte_text():
    assert estimate_embed_tokens({"texts": ["ééé"]}) == 2 + 2  # 6 bytes / 3, +2 special tokens


def test_engine_groups_in_lane_order():
    assert [(name, [lane.name for lane in lanes]) for name, lanes in engine_groups(DEFAULT_LANES)] == [
        ("main", ["short", "medium", "long"])]  # the default: one running batch for every lane
    two = (LaneSpec("short", 128, engine="short"), LaneSpec("medium", 512), LaneSpec("long", None))
    assert [(name, [lane.name for lane in lanes]) for name, lanes in engine_groups(two)] == [
        ("short", ["short"]), ("main", ["medium", "long"])]
    one = (LaneSpec("a", 10), LaneSpec("b", None))
    assert [name for name, _ in engine_groups(one)] == ["main"]
