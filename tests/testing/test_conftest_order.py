"""The order the suite runs its modules in (tests/conftest.py, testing/suite_order.py)."""

from __future__ import annotations

from pathlib import Path

from lmc_server.testing.suite_order import LONGEST_FIRST, module_rank

TESTS = Path(__file__).resolve().parents[1]


def test_longest_first_names_existing_test_modules() -> None:
    found = {path.name for path in TESTS.rglob("test_*.py")}
    missing = [name for name in LONGEST_FIRST if name not in found]
    assert not missing, f"LONGEST_FIRST names modules that are gone: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_test_module_names_are_unique_across_folders() -> None:
    """The suite order keys modules by file name, and pytest imports a test module by its
    file name (no packages under tests/): two folders holding one name would collide."""
    names = [path.name for path in TESTS.rglob("test_*.py")]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"test modules sharing a file name: {twice}"


def test_cached_durations_rank_longest_first() -> None:
    cached = {name: 1.0 for name in LONGEST_FIRST}
    cached.update({"test_a.py": 2.0, "test_b.py": 30.0, "test_c.py": 4.5})
    order = sorted(module_rank(cached), key=module_rank(cached).__getitem__)
    assert order[:3] == ["test_b.py", "test_c.py", "test_a.py"]
    assert set(order[3:]) == set(LONGEST_FIRST)


def test_listed_modules_without_a_cached_duration_come_first() -> None:
    rank = module_rank({"test_a.py": 2.0, LONGEST_FIRST[0]: 0.5})
    order = sorted(rank, key=rank.__getitem__)
    assert order == [*LONGEST_FIRST[1:], "test_a.py", LONGEST_FIRST[0]]


def test_without_a_cache_the_list_is_the_order() -> None:
    empty: dict[str, float] = {}
    for cached in (None, empty):
        rank = module_rank(cached)
        assert sorted(rank, key=rank.__getitem__) == list(LONGEST_FIRST)
