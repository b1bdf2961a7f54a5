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


def test_a_number_as_ground_truth_reaches_a_custom_function_as_it_is_and_the_rules_read_its_positional_text(
        tmp_path):
    """verl passes a stored 72 as 72: a function doing `pred == ground_truth` scored 0 on the
    text '72' the rows held. The rules read a number as positional text ('1e-05' was no
    number to the reader)."""
    from distflow.engines.reward import OK, RewardRunner, default_compute_score, gsm8k_score, math_verify_score

    path = tmp_path / "numbers.jsonl"
    truths = [1e-05, 2.5, 72, 1e16, "0.5", True]
    path.write_text("\n".join(json.dumps({**_verl_row(i), "reward_model": {"ground_truth": t}})
                              for i, t in enumerate(truths)))
    rows = load_rows(str(path))
    assert [r.ground_truth for r in rows] == truths
    assert [type(r.ground_truth) for r in rows] == [float, float, int, float, str, bool]
    assert gsm8k_score("#### 0.00001", rows[0].ground_truth) == 1.0
    assert math_verify_score("$\\boxed{0.00001}$", rows[0].ground_truth) == 1.0
    assert default_compute_score("mydata", "#### 10,000,000,000,000,000", rows[3].ground_truth) == 1.0
    (tmp_path / "typed.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(int(solution_str) == ground_truth and type(ground_truth) is int)\n")
    for timeout_s in (0.0, 30.0):  # in this process, and through the child's JSON
        assert RewardRunner(f"{tmp_path / 'typed.py'}:score", timeout_s)("s", "72", rows[2].ground_truth, {}) == \
            (1.0, OK)


def test_a_structured_ground_truth_reaches_a_custom_reward_function_as_it_is(tmp_path):
    """verl's search and tool datasets keep a mapping as the ground truth
    (`{"target": ["Paris"]}`) and pass it to the reward function whole; so do code datasets
    that store their test cases as a mapping. Such rows were refused as bad rows. The
    default reward scores code cases given as a mapping, and says in one line that it reads
    no other structure."""
    from distflow.engines.reward import OK, RewardRunner, default_compute_score

    path = tmp_path / "search.jsonl"
    truths = [{"target": ["Paris", "paris"]}, ["4", "four"]]
    path.write_text("\n".join(json.dumps({**_verl_row(i), "reward_model": {"ground_truth": t}})
                              for i, t in enumerate(truths)))
    rows = load_rows(str(path))
    assert [r.ground_truth for r in rows] == truths
    (tmp_path / "exact.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    targets = ground_truth['target'] if isinstance(ground_truth, dict) else ground_truth\n"
        "    return float(solution_str in targets)\n")
    for timeout_s in (0.0, 30.0):  # in this process, and through the child's JSON
        runner = RewardRunner(f"{tmp_path / 'exact.py'}:score", timeout_s)
        assert [runner("s", "paris", rows[0].ground_truth, {}), runner("s", "five", rows[1].ground_truth, {})] == \
            [(1.0, OK), (0.0, OK)]
    # accuracy, the rule's full marks where it reads the truth, is the custom function's where it reads none
    import torch

    from distflow.data.batch import Batch
    from distflow.engines.tiny_model import build_tokenizer
    from distflow.trainer.nodes import score_responses

    tok = build_tokenizer()
    answers = [tok("#### 4", add_special_tokens=False)["input_ids"], tok("#### 5", add_special_tokens=False)["input_ids"]]
    responses = torch.tensor([a + [tok.pad_token_id] * (8 - len(a)) for a in answers])
    batch = Batch({"responses": responses, "response_mask": (responses != tok.pad_token_id).long()},
                  {"ground_truth": [["4"], "4"], "data_source": ["search"] * 2, "extra_info": [{}] * 2})
    (tmp_path / "listed.py").write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(isinstance(ground_truth, list) and solution_str.endswith(ground_truth[0]))\n")
    listed = RewardRunner(f"{tmp_path / 'listed.py'}:score", 0.0)
    scores, accuracy, status, _ = score_responses(tok, batch, listed, RewardRunner(None, 0.0))
    assert scores.tolist() == [1.0, 0.0] and accuracy.tolist() == [1.0, 0.0] and status.tolist() == [OK, OK]
    cases = {"inputs": ["2\n"], "outputs": ["4"]}
    assert default_compute_score("codecontests", "```python\nprint(int(input()) * 2)\n```", cases) == 1.0
    with pytest.raises(ValueError, match=r"^the default reward reads a ground truth of text or a number, not a dict; "
                                         r"set reward.custom_fn to score this data_source \('openai/gsm8k'\)$"):
        default_compute_score("openai/gsm8k", "#### 4", rows[0].ground_truth)


def test_limit():
    assert len(load_rows("builtin:arith:test", limit=7)) == 7


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": []}, "line 2: 'prompt' must be a non-empty list"),
    ({"prompt": [{"role": "user"}]}, "line 2: each prompt message needs"),
    ({"reward_model": {}}, "line 2: missing 'reward_model.ground_truth'"),
    ({"prompt": [{"role": "user", "content": "  "}]}, "line 2: the prompt is empty"),
    ({"prompt": 7}, "line 2: 'prompt' must be a non-empty list"),
    # a chat template renders no message of an unknown role: the question was dropped from the prompt, silently
    ({"prompt": [{"role": "human", "content": "q"}]}, "line 2: a prompt message has role 'human'; expected one of "
                                                      "system, developer, user, assistant, tool"),
    ({"prompt": [{"role": None, "content": "q"}]}, "line 2: a prompt message has role None"),
    ({"prompt": '[{"role": "user", "content": "What is 4+4?"}]'}, "line 2: 'prompt' is chat messages written as "
                                                                  "JSON text"),
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
    with pytest.raises(DatasetError, match="unknown built-in dataset"):
        load_rows("builtin:arith:dev")
    with pytest.raises(DatasetError, match="TASK one of arith, arith-tools"):
        load_rows("builtin:gsm8k:train")


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
    # a step's rows come in shuffled order: each row group is still read once, with the row columns only
    from distflow.data.dataset import PromptReader

    data = ShardedDataset(str(path))
    taken, _ = PromptReader(data, max_len=8).take([57, 12, 55, 15, 13, 58], _words)
    assert [row.index for row, _ in taken] == [57, 12, 55, 15, 13, 58] and data.rows_read == 20
    assert data.sources[0].columns == ["prompt", "reward_model", "data_source", "extra_info"]


def test_a_json_file_may_hold_one_array_of_rows(tmp_path):
    """`json.dump(rows)` (indented or not) and pandas' `to_json(orient="records")` write one
    array; each was read as JSON lines (one row of a list, or a parse error on line 1)."""
    from distflow.data.dataset import ShardedDataset

    rows = [_verl_row(i) for i in range(3)]
    (tmp_path / "pretty.json").write_text(json.dumps(rows, indent=2))
    (tmp_path / "flat.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())  # as some Windows tools save
    # JSON lines with one: the first row failed, at the step that drew it
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    for name in ("pretty.json", "flat.json", "lines.json", "bom.json", "bom.jsonl"):
        data = ShardedDataset(str(tmp_path / name))
        assert [r.ground_truth for r in data.rows([0, 1, 2])] == ["0", "1", "2"]
    (tmp_path / "cut.json").write_text(json.dumps(rows)[:-5])
    with pytest.raises(DatasetError, match="cut.json: not a UTF-8 JSON array of rows"):
        ShardedDataset(str(tmp_path / "cut.json"))


def test_jsonl_rows_are_parsed_on_demand(tmp_path):
    from distflow.data.dataset import ShardedDataset

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(_verl_row(i)) for i in range(50)) + "\n{broken\n")
    data = ShardedDataset(str(path))
    assert len(data) == 51
    assert data.rows([7, 3])[0].ground_truth == "7" and data.rows_read == 2
    with pytest.raises(DatasetError, match=r"line 51 is not UTF-8 JSON \(Expecting property name enclosed in "
                                           r"double quotes, column 2\)$"):
        data.rows([50])
    # a byte-order mark alone on the first line, and a line of no-break spaces, are blank lines, not bad rows
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_bytes(b"\xef\xbb\xbf\n" + json.dumps(_verl_row(0)).encode() + "\n\u00a0\u00a0\n".encode()
                       + json.dumps(_verl_row(1)).encode() + b"\n")
    data = ShardedDataset(str(spaced))
    assert len(data) == 2 and [r.ground_truth for r in data.rows([0, 1])] == ["0", "1"]


# ---------------------------------------------------------------------------- the bad-row policy


def _words(row):
    """A stand-in tokenizer: one id per word of the prompt."""
    return [len(w) for m in row.messages for w in m["content"].split()]


def _mixed_file(tmp_path):
    """20 rows; rows 3 (no ground truth), 7 (empty prompt), 11 (not UTF-8) are malformed,
    row 15's prompt has 12 words."""
    lines = [json.dumps(_verl_row(i)).encode() for i in range(20)]
    lines[3] = json.dumps(_verl_row(3, reward_model={})).encode()
    lines[7] = json.dumps(_verl_row(7, prompt=[{"role": "user", "content": ""}])).encode()
    lines[11] = b'{"prompt": "caf\xe9"}'
    lines[15] = json.dumps(_verl_row(15, prompt="w " * 12)).encode()
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_bad_rows_are_errors_naming_file_row_and_the_policy_by_default(tmp_path):
    from distflow.data.dataset import PromptReader, ShardedDataset

    path = _mixed_file(tmp_path)
    reader = PromptReader(ShardedDataset(str(path)), max_len=4)
    with pytest.raises(DatasetError, match=r"mixed.jsonl: line 4: missing .* \(data.on_bad_row=skip to go on\)"):
        reader.take([0, 3], _words)
    with pytest.raises(DatasetError, match=r"line 16: the prompt has 12 tokens > data.max_prompt_length=4 "
                                           r"\(data.on_long_prompt=skip or truncate to go on\)"):
        PromptReader(ShardedDataset(str(path)), max_len=4, on_bad_row="skip").take([15], _words)


def test_skipped_rows_are_counted_and_replaced_the_same_way_for_any_number_of_workers(tmp_path):
    from distflow.data.dataset import PromptReader, ShardedDataset

    reader = PromptReader(ShardedDataset(str(_mixed_file(tmp_path))), max_len=4, on_bad_row="skip",
                          on_long_prompt="skip", seed=3)
    indices = list(range(20))
    taken, counts = reader.take(indices, _words)
    bad = (3, 7, 11, 15)
    assert len(taken) == 20 and set(counts) == {"skipped_rows"} and counts["skipped_rows"] >= 4  # replacements may be bad too
    assert all(row.index not in bad and len(ids) <= 4 for row, ids in taken)
    assert all(row.index == i for i, (row, _) in zip(indices, taken) if i not in bad)
    # two workers taking interleaved halves (with their positions in the draw) get exactly the rows of the whole
    halves = [reader.take(indices[r::2], _words, draw=indices, positions=range(r, 20, 2))[0] for r in range(2)]
    assert [row.index for row, _ in taken] == [row.index for pair in zip(*halves) for row, _ in pair]
    # a draw of 8 rows: the replacement of its bad row is none of the 8 (on any number of workers)
    draw = [0, 1, 2, 3, 4, 5, 6, 8]
    for seed in (5, 11):
        reader = PromptReader(ShardedDataset(str(_mixed_file(tmp_path))), max_len=4, on_bad_row="skip",
                              on_long_prompt="skip", seed=seed)
        taken, _ = reader.take(draw, _words)
        replacement = taken[3][0].index
        assert replacement not in draw and replacement not in bad
        assert [row.index for row, _ in reader.take(draw[1::2], _words, draw=draw, positions=range(1, 8, 2))[0]][1] \
            == replacement
    # without replacement (held-out rows), bad rows are dropped
    kept, counts = reader.take(indices, _words, replace=False)
    assert [row.index for row, _ in kept] == [i for i in indices if i not in (3, 7, 11, 15)]
    assert counts == {"skipped_rows": 4}


def test_replacements_never_repeat_a_row_of_the_step(tmp_path):
    """10% of 2,000 rows are bad and a step draws 500: each replacement is a row of its
    own, outside the draw (two bad rows once shared one: the same row, with the same
    sampling seeds, twice in a step: a duplicated group), and workers agree on them."""
    from distflow.data.dataset import PromptReader, ShardedDataset
    from distflow.data.loader import ShardedSampler

    path = tmp_path / "tenth_bad.jsonl"
    path.write_text("\n".join(json.dumps(_verl_row(i, reward_model={}) if i % 10 == 3 else _verl_row(i))
                              for i in range(2000)) + "\n")
    reader = PromptReader(ShardedDataset(str(path)), max_len=8, on_bad_row="skip", seed=0)
    sampler = ShardedSampler(2000, 500, 0, 1, seed=0)  # no step straddles two epochs
    for step in range(1, 9):
        draw = sampler.global_indices(step)
        taken, counts = reader.take(draw, _words, draw=draw, positions=range(500))
        rows = [row.index for row, _ in taken]
        assert counts["skipped_rows"] >= 40 and len(set(rows)) == 500 and all(r % 10 != 3 for r in rows)
        per_worker = [reader.take(draw[r::2], _words, draw=draw, positions=range(r, 500, 2))[0] for r in range(2)]
        assert rows == [row.index for pair in zip(*per_worker) for row, _ in pair]


def test_truncation_keeps_the_end_of_a_long_prompt(tmp_path):
    from distflow.data.dataset import PromptReader, ShardedDataset

    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps(_verl_row(0, prompt="a bb ccc dddd eeeee")) + "\n")
    (row, ids), = PromptReader(ShardedDataset(str(path)), max_len=3, on_long_prompt="truncate").take([0], _words)[0]
    assert ids == [3, 4, 5] and row.index == 0


def test_a_dataset_of_only_bad_rows_stops_with_a_clear_error_under_skip(tmp_path):
    from distflow.data.dataset import PromptReader, ShardedDataset

    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(_verl_row(i, reward_model={})) for i in range(5)) + "\n")
    with pytest.raises(DatasetError, match="replacement rows in a row were bad as well"):
        PromptReader(ShardedDataset(str(path)), max_len=8, on_bad_row="skip").take([0], _words)


def test_a_row_with_videos_is_a_bad_row_not_one_trained_on_its_text_alone(tmp_path):
    """verl's `videos` column: DistFlow reads images only; a video row trained on its
    text with a literal <video> in it, and nothing said so."""
    path = tmp_path / "videos.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(0, videos=[{"video": "/data/clip.mp4", "fps": 2}]),
                                         _verl_row(1, videos=[])]), path)
    with pytest.raises(DatasetError, match=r"videos.parquet: row 0: 'videos' holds videos, which DistFlow does not "
                                           r"read \(images only\)"):
        load_rows(str(path))
    from distflow.data.dataset import PromptReader, ShardedDataset

    rows, counts = PromptReader(ShardedDataset(str(path)), max_len=64, on_bad_row="skip").take([0, 1], _words,
                                                                                               replace=False)
    assert [row.index for row, _ in rows] == [1] and counts["skipped_rows"] == 1  # an empty list is no video


def test_extra_info_reaches_every_worker_as_json_gives_it_back_and_other_values_are_bad_rows(tmp_path):
    """Rows that move between workers travel as JSON: a kept row must not differ from a
    moved one (tuples become lists, keys strings), dates and decimals become their text (a
    date in a parquet extra_info made every row bad), and what JSON cannot hold is a bad row."""
    import datetime
    import decimal

    mapped = tmp_path / "map.parquet"
    pairs = pa.array([[(1, "a"), (2, "b")]], type=pa.map_(pa.int64(), pa.string()))
    pq.write_table(pa.Table.from_pylist([_verl_row(0)]).drop(["extra_info"]).append_column(
        "extra_info", pa.StructArray.from_arrays([pairs], names=["labels"])), mapped)
    (row,) = load_rows(str(mapped))
    assert row.extra_info == {"labels": {"1": "a", "2": "b"}}  # a map (Spark's MapType) is a mapping: it was pairs
    spark = tmp_path / "spark.parquet"  # every dict column a map: a map reward_model was "missing" its ground truth
    pq.write_table(pa.table({"prompt": pa.array([[{"role": "user", "content": "q"}]]),
                             "reward_model": pa.array([[("ground_truth", "4")]], type=pa.map_(pa.string(), pa.string())),
                             "extra_info": pa.array([[("split", "train")]], type=pa.map_(pa.string(), pa.string()))}),
                   spark)
    (row,) = load_rows(str(spark))
    assert (row.ground_truth, row.extra_info) == ("4", {"split": "train"})
    dated = tmp_path / "dated.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(0, extra_info={"when": datetime.date(2026, 12, 6),
                                                                   "price": decimal.Decimal("1.10")})]), dated)
    assert load_rows(str(dated))[0].extra_info == {"when": "2026-12-06", "price": "1.10"}
    binary = tmp_path / "binary.parquet"
    pq.write_table(pa.Table.from_pylist([_verl_row(0, extra_info={"blob": b"\x00\x01"})]), binary)
    with pytest.raises(DatasetError, match=r"binary.parquet: row 0: 'extra_info' must hold JSON values .*bytes"):
        load_rows(str(binary))
    # an extra_info that is not a mapping reaches the reward function as it is, as verl passes it (it was {})
    texts = tmp_path / "texts.jsonl"
    texts.write_text("\n".join(json.dumps(_verl_row(i, extra_info=v)) for i, v in
                               enumerate(['{"tests": [1, 2]}', [1, 2], None])) + "\n")
    assert [r.extra_info for r in load_rows(str(texts))] == ['{"tests": [1, 2]}', [1, 2], {}]


def test_a_prompt_the_chat_template_refuses_is_a_bad_row_under_the_policy(tmp_path):
    """Templates raise on messages they do not take ("System role not supported"): that
    row is bad, named, and skipped and replaced under on_bad_row=skip."""
    from distflow.data.dataset import PromptReader, ShardedDataset

    def refusing(row):
        if row.index == 2:
            raise RuntimeError("System role not supported")  # as jinja2's TemplateError from raise_exception
        return _words(row)

    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(_verl_row(i)) for i in range(6)) + "\n")
    with pytest.raises(DatasetError, match=r"rows.jsonl: line 3: the prompt could not be encoded \(RuntimeError: "
                                           r"System role not supported\) \(data.on_bad_row=skip to go on\)"):
        PromptReader(ShardedDataset(str(path)), max_len=64).take([2], refusing)
    taken, counts = PromptReader(ShardedDataset(str(path)), max_len=64, on_bad_row="skip").take([1, 2], refusing)
    assert len(taken) == 2 and 2 not in [row.index for row, _ in taken] and counts["skipped_rows"] >= 1
