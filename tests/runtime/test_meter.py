import numpy as np
import torch

from distflow.runtime.ray_launcher import ReceivedBytes, payload_bytes


def test_payload_bytes_counts_tensor_content_anywhere():
    obj = {"a": torch.zeros(10, 4, dtype=torch.int64), "b": [np.zeros(5, dtype=np.float32), b"xyz"],
           "c": {"d": (torch.ones(3, dtype=torch.float16),)}, "s": "a string", "n": 3.5}
    assert payload_bytes(obj) == 10 * 4 * 8 + 5 * 4 + 3 + 3 * 2


def test_control_only_objects_have_no_payload():
    meter = ReceivedBytes()
    meter.count({"heldout_accuracy_final": 0.5, "steps": 3, "run_dir": "/x"})
    assert meter.payload == 0 and meter.control > 0
    meter.count([torch.zeros(100)])
    assert meter.payload == 400
