"""The single controller's wire (runtime.centralized_wire): our numpy buffers, and verl's
own DataProto with its two serialisations, carry a batch's fields unchanged; without verl
its wires are refused in one line. Where verl is installed (.ci/run's verl environment),
the end-to-end benchmark's `--baseline verl` trains the same steps through every wire."""

from __future__ import annotations

import importlib.util
import json
import pickle

import pytest
import torch

from distflow.benchmarks import e2e
from distflow.cli import main as cli_main
from distflow.data.batch import Batch
from distflow.runtime.centralized import VERL_INSTALL, NumpyWire, make_wire, wire_env

HAS_VERL = importlib.util.find_spec("verl") is not None


def _batch() -> Batch:
    return Batch({"input_ids": torch.arange(12, dtype=torch.int64).view(3, 4),
                  "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]], dtype=torch.bool),
                  "old_log_probs": torch.randn(3, 5)},
                 {"ground_truth": ["4", "17", "x"], "messages": [["a", "b"], ["c", "d"], ["e", "f"]]})


def _assert_same(got: Batch, want: Batch) -> None:
    assert set(got.tensors) == set(want.tensors)
    for k, v in want.tensors.items():
        assert got.tensors[k].dtype == v.dtype and torch.equal(got.tensors[k], v), k
        got.tensors[k][0] = got.tensors[k][0]  # writable: the worker's store updates it in place
    assert got.meta == want.meta


def test_the_numpy_wire_carries_every_field():
    wire = make_wire("numpy")
    assert isinstance(wire, NumpyWire) and wire_env("numpy") == {}
    batch = _batch()
    sent = wire.encode(batch)
    assert wire.nbytes(sent) == 3 * 4 * 8 + 3 * 3 + 3 * 5 * 4
    _assert_same(wire.decode(pickle.loads(pickle.dumps(sent))), batch)


@pytest.mark.skipif(HAS_VERL, reason="checks the answer without verl")
def test_without_verl_its_wires_are_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^runtime.centralized_wire=verl-numpy needs verl in this Python: "):
        make_wire("verl-numpy")
    code = cli_main(["train", "runtime.mode=centralized", "runtime.centralized_wire=verl", "runtime.network=host",
                     f"trainer.output_dir={tmp_path / 'run'}"])
    assert code != 0
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"runtime.centralized_wire=verl needs verl in this Python: {VERL_INSTALL}")
    assert not (tmp_path / "run").exists()  # refused before a run folder or Ray
    with pytest.raises(SystemExit) as e:
        e2e.main(["--quick", "--baseline", "verl"])
    assert e.value.code == 2


@pytest.mark.verl
@pytest.mark.skipif(not HAS_VERL, reason="verl is not installed here (README: Benchmarks; .ci/run runs these)")
@pytest.mark.parametrize("name", ["verl", "verl-numpy"])
def test_verls_dataproto_carries_every_field_with_its_own_serialisation(monkeypatch, name):
    from verl import DataProto

    for k, v in wire_env(name).items():
        monkeypatch.setenv(k, v)
    if name == "verl":
        monkeypatch.delenv("VERL_DATAPROTO_SERIALIZATION_METHOD", raising=False)
    wire, batch = make_wire(name), _batch()
    sent = wire.encode(batch)
    assert isinstance(sent, DataProto) and wire.nbytes(sent) == 3 * 4 * 8 + 3 * 3 + 3 * 5 * 4
    # verl's __getstate__: torch.save bytes by default, numpy-encoded tensors with its numpy method
    state = sent.__getstate__()[0]
    assert isinstance(state, bytes) if name == "verl" else isinstance(state, tuple)
    _assert_same(wire.decode(pickle.loads(pickle.dumps(sent))), batch)


@pytest.mark.verl
@pytest.mark.slow
@pytest.mark.skipif(not HAS_VERL, reason="verl is not installed here (README: Benchmarks; .ci/run runs these)")
def test_e2e_against_verl_trains_the_same_steps_through_every_wire(tmp_path):
    jsonl = tmp_path / "e2e.jsonl"
    assert e2e.main(["--quick", "--baseline", "verl", "--json", str(jsonl)]) == 0
    records = {r["mode"]: r for r in map(json.loads, jsonl.read_text().splitlines())}
    assert set(records) == {"distributed", "centralized", "centralized-verl", "centralized-verl-numpy"}
    assert {m: records[m]["centralized_wire"] for m in records} == {
        "distributed": None, "centralized": "numpy", "centralized-verl": "verl",
        "centralized-verl-numpy": "verl-numpy"}
    central = [records[m] for m in ("centralized", "centralized-verl", "centralized-verl-numpy")]
    # the same rows through every wire: the same training, the same driver bytes
    assert len({r["reward_last"] for r in central}) == 1
    assert len({(r["driver_bytes_in"], r["driver_bytes_out"]) for r in central}) == 1
    assert central[0]["driver_bytes_in"] > 0
    distributed = records["distributed"]
    for mode in ("centralized", "centralized-verl", "centralized-verl-numpy"):
        assert distributed[f"speedup_vs_{mode}"] > 0
