import re

from hypothesis import given
from hypothesis import strategies as st

from shared.idempotency_keys import MAX_KEY_CHARS, derived_key, valid_idempotency_key
from shared.ids import created_ms, is_request_id, new_request_id
from shared.keys import Keys

TAG = re.compile(r"\{([^}]*)\}")


def test_keys_touched_together_share_a_hash_tag():
    k = Keys("bg")
    streams = k.lane_streams("tiny-llama", ["short", "medium", "long"])
    tags = {TAG.search(s).group(1) for s in [*streams, k.dead_letter("tiny-llama"), k.lane_stats("tiny-llama")]}
    assert tags == {"m:tiny-llama"}
    assert TAG.search(k.record("req_a")).group(1) == TAG.search(k.done_channel("req_a")).group(1) == "r:req_a"


def test_prefix_isolates_deployments():
    assert Keys("a").record("req_x") != Keys("b").record("req_x")
    assert Keys("a").record("req_x").startswith("a:")


def test_idempotency_key_is_hashed_and_tenant_scoped():
    k = Keys()
    assert k.idempotency("t1", "key") != k.idempotency("t2", "key")
    assert "key with spaces" not in k.idempotency("t1", "key with spaces")


@given(st.text(min_size=1, max_size=MAX_KEY_CHARS), st.integers(min_value=1, max_value=9999))
def test_a_derived_key_is_never_a_key_a_caller_can_send(key, index):
    """A keyed call's later requests (OpenAI choices, batch items) get derived keys: distinct per index, and none
    equal to a caller's own key, whatever the caller sends (`<key>#<i>` was: `abc#1` found `abc`'s second choice)."""
    assert not valid_idempotency_key(derived_key(key, index))
    assert derived_key(key, index) != derived_key(key, index + 1) and derived_key(key, index) != key
    assert Keys().idempotency("t", derived_key(key, index)) != Keys().idempotency("t", f"{key}#{index}")


def test_request_ids_are_random_and_validated():
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(is_request_id(i) for i in ids)
    for bad in ("", "req_", "req_UPPERCASE0000000000000000", "../etc/passwd", "req_" + "a" * 27, "x" * 30):
        assert not is_request_id(bad)


def test_ids_carry_their_creation_time():
    rid = new_request_id(now_ms=1_795_000_000_123)
    assert created_ms(rid) == 1_795_000_000_123
    assert created_ms("req_x") is None
    assert new_request_id(now_ms=1) < new_request_id(now_ms=2)  # time-ordered
