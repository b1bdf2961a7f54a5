import re

import pytest

from distflow.data.dataset import load_rows, write_builtin_parquet
from distflow.data.tasks import arith
from distflow.engines.reward import gsm8k_score


def test_splits_are_deterministic_and_disjoint():
    a, b = arith.generate("train", 500), arith.generate("train", 500)
    assert [p.question for p in a] == [p.question for p in b]
    test = arith.generate("test", 200)
    assert not {p.question for p in a} & {p.question for p in test}
    assert len({p.question for p in a}) == 500


def test_other_seed_other_problems():
    assert arith.generate("train", 50, seed=1)[0].question != arith.generate("train", 50, seed=0)[0].question


def test_solutions_are_correct_arithmetic_and_gsm8k_format():
    for p in arith.generate("train", 400, levels=arith.TOOL_TASK_LEVELS):
        for lhs, rhs in re.findall(r"([\d+\-*]+)=(\d+)", p.solution):
            assert eval(lhs) == int(rhs)  # noqa: S307 - digits and operators only
        assert p.solution.endswith(f"#### {p.answer}") and eval(p.expression) == p.answer  # noqa: S307
        assert gsm8k_score(p.solution, str(p.answer)) == 1.0
    assert {p.level for p in arith.generate("test", 30)} == set(arith.LEVELS)


def test_the_tool_task_adds_two_digit_products_and_keeps_the_other_levels():
    rows = load_rows("builtin:arith-tools:test:40")
    assert [r.extra_info["level"] for r in rows[:4]] == [1, 2, 3, 4]
    large = [p for p in arith.generate("test", 40, levels=arith.TOOL_TASK_LEVELS) if p.level == 4]
    assert len(large) == 10 and all(p.answer >= 121 for p in large)
    assert not {p.question for p in large} & {p.question for p in arith.generate("train", 4000,
                                                                                 levels=arith.TOOL_TASK_LEVELS)}


def test_parquet_roundtrip_equals_builtin(tmp_path):
    path = write_builtin_parquet(str(tmp_path / "train.parquet"), "arith", "train", 40)
    from_file = load_rows(path)
    builtin = load_rows("builtin:arith:train:40")
    assert from_file == builtin
    row = from_file[3]
    assert row.messages[0]["role"] == "user" and row.data_source == arith.DATA_SOURCE
    assert row.extra_info["split"] == "train" and row.extra_info["index"] == 3


def test_asking_for_more_problems_than_a_split_has_is_refused():
    with pytest.raises(ValueError, match="the test split runs out of distinct level-3 problems after 4880 of the 5000"):
        arith.generate("test", 5000)
