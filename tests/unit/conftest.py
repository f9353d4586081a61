"""The unit tier is pure: no Redis, no model, no torch. Under `make test-fast` the run fails if anything imported
torch (`tests/torch_guard.py`, whose hooks `tests/conftest.py` takes in)."""
