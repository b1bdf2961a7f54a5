import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distflow.data.dataset import DatasetError, load_rows


def _verl_row(i, **overrides):
    row = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}],
           "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
    row.update(overrides)
    return row


def test_jsonl_and_several_files_concatenate(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    a.write_text("\n".join(json.dumps(_verl_row(i)) for i in range(3)))
    pq.write_table(pa.Table.from_pylist([_verl_row(i) for i in range(3, 5)]), b)
    rows = load_rows(f"{a},{b}")
    assert [r.index for r in rows] == [0, 1, 2, 3, 4]
    assert [r.ground_truth for r in rows] == ["0", "1", "2", "3", "4"]
    assert rows[4].messages == [{"role": "user", "content": "q4"}]


def test_limit():
    assert len(load_rows("builtin:arith:test", limit=7)) == 7


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": []}, "row 1: 'prompt' must be a non-empty list"),
    ({"prompt": [{"role": "user"}]}, "row 1: each prompt message needs"),
    ({"reward_model": {}}, "row 1: missing 'reward_model.ground_truth'"),
])
def test_malformed_row_names_file_and_row(tmp_path, bad, fragment):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(_verl_row(0)) + "\n" + json.dumps(_verl_row(1, **bad)) + "\n")
    with pytest.raises(DatasetError, match=fragment) as err:
        load_rows(str(path))
    assert str(path) in str(err.value)


def test_not_parquet_empty_and_bad_json(tmp_path):
    fake = tmp_path / "x.parquet"
    fake.write_text("hello")
    with pytest.raises(DatasetError, match="not a readable parquet file"):
        load_rows(str(fake))
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(DatasetError, match="the dataset is empty"):
        load_rows(str(empty))
    broken = tmp_path / "b.jsonl"
    broken.write_text(json.dumps(_verl_row(0)) + "\n{oops\n")
    with pytest.raises(DatasetError, match="line 2 is not UTF-8 JSON"):
        load_rows(str(broken))
    latin = tmp_path / "l.jsonl"
    latin.write_bytes(json.dumps(_verl_row(0)).encode() + b"\n" + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DatasetError, match="line 2 is not UTF-8 JSON"):
        load_rows(str(latin))
    with pytest.raises(DatasetError, match="unknown built-in split"):
        load_rows("builtin:arith:dev")


def test_a_worker_reads_only_the_row_groups_of_its_shard(tmp_path):
    from distflow.data.dataset import ShardedDataset

    path = tmp_path / "big.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(i) for i in range(100)]), path, row_group_size=10)
    data = ShardedDataset(str(path))
    assert len(data) == 100 and data.rows_read == 0  # the footer alone gives the length
    rows = data.rows([12, 15, 57, 13])
    assert [r.ground_truth for r in rows] == ["12", "15", "57", "13"]
    assert data.rows_read == 20  # row groups 1 and 5 only
    assert [r.index for r in rows] == [12, 15, 57, 13]


def test_jsonl_rows_are_parsed_on_demand(tmp_path):
    from distflow.data.dataset import ShardedDataset

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(_verl_row(i)) for i in range(50)) + "\n{broken\n")
    data = ShardedDataset(str(path))
    assert len(data) == 51
    assert data.rows([7, 3])[0].ground_truth == "7" and data.rows_read == 2
    with pytest.raises(DatasetError, match="line 51 is not UTF-8 JSON"):
        data.rows([50])
