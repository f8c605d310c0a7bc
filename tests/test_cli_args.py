"""The shared checks: ``moeshard.validate`` (ints) and ``moeshard.commands.args`` (option lists)."""

import pytest

from moeshard.commands.args import ints, layouts, names
from moeshard.parallel.config import ParallelConfig
from moeshard.validate import index, int_at_least, is_int, nonneg_int, positive_int


def test_int_checks_return_the_value():
    assert positive_int("X", "n", 3) == 3 and nonneg_int("X", "n", 0) == 0
    assert int_at_least("X", "n", 5, 5) == 5 and index("X", "i", 2, 3) == 2
    assert is_int(4) and not is_int(True) and not is_int(4.0) and not is_int("4")


@pytest.mark.parametrize("check, message", [
    (lambda: positive_int("X", "n", 0), "X.n: must be a positive integer, got 0"),
    (lambda: positive_int("X", "n", True), "X.n: must be a positive integer, got True"),
    (lambda: positive_int("X", "n", 2.0), "X.n: must be a positive integer, got 2.0"),
    (lambda: nonneg_int("X", "n", -1), "X.n: must be an integer >= 0, got -1"),
    (lambda: nonneg_int("X", "n", False), "X.n: must be an integer >= 0, got False"),
    (lambda: int_at_least("X", "n", 1, 2), "X.n: must be an integer >= 2, got 1"),
    (lambda: index("X", "i", 3, 3), "X.i: must be an integer in [0, 3), got 3"),
    (lambda: index("X", "i", -1, 3), "X.i: must be an integer in [0, 3), got -1"),
])
def test_int_checks_name_the_field_and_the_value(check, message):
    with pytest.raises(ValueError) as info:
        check()
    assert str(info.value) == message


def test_ints_and_names():
    assert ints("1,16, 64", "--decode-tokens") == (1, 16, 64) and ints("2,", "--world-sizes") == (2,)
    with pytest.raises(ValueError) as info:
        ints("1,x", "--world-sizes")
    assert str(info.value) == "--world-sizes: '1,x' is not a comma-separated list of integers"
    assert names(" a, b,,") == ("a", "b") and names(None) is None


def test_layouts():
    assert layouts("dp2-tp2-ep,dp1-tp2-noep") == (ParallelConfig(2, 2, True), ParallelConfig(1, 2, False))
    assert layouts("2,2,on;1,2,off") == (ParallelConfig(2, 2, True), ParallelConfig(1, 2, False))
    with pytest.raises(ValueError) as info:
        layouts("dp2-tp2-ep,dp2-tp1-bogus")
    assert str(info.value).startswith("--layouts: 'dp2-tp1-bogus' is not a layout; write dp<D>-tp<T>-ep")
    with pytest.raises(ValueError, match=r"^--only-layouts: '2,2' is not a layout"):
        layouts("2,2", "--only-layouts")
