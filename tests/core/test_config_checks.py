"""core/config_checks.py: one message naming the key, the valid keys and the closest one, or the type in plain
words, for a table a user wrote."""

from __future__ import annotations

import pytest

from peerloom.core.config_checks import TableError, check_keys, check_table, typed

KEYS = {"listen": str, "port": int, "rate": float, "peers": list}


def test_check_table_names_an_unknown_key_with_the_closest_valid_one() -> None:
    with pytest.raises(TableError, match=r"relay\.lisen: unknown key \(did you mean 'listen'\?\); valid keys: "
                                         r"listen, peers, port, rate"):
        check_table({"lisen": "x"}, KEYS, "relay")


def test_check_table_names_a_wrong_type_in_plain_words() -> None:
    with pytest.raises(TableError, match=r"relay\.port must be an integer, got '80'"):
        check_table({"port": "80"}, KEYS, "relay")
    with pytest.raises(TableError, match=r"^rate must be a number, got True"):
        check_table({"rate": True}, KEYS)


def test_check_table_accepts_known_keys_of_their_types_and_absent_ones() -> None:
    check_table({"listen": "127.0.0.1:0", "port": 1, "rate": 2}, KEYS)  # an int passes where a float is asked
    check_table({}, KEYS)


def test_typed_refuses_non_finite_numbers_and_floats_for_integers() -> None:
    assert typed({"rate": 3}, "rate", float) == 3.0
    with pytest.raises(TableError, match="must be a number"):
        typed({"rate": float("nan")}, "rate", float)
    with pytest.raises(TableError, match="must be an integer"):
        typed({"port": 1.0}, "port", int)
    with pytest.raises(TableError, match="unknown key"):
        check_keys({"x": 1}, KEYS)
