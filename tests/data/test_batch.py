"""What a sample weighs for the balancer and the token budgets."""

import torch

from distflow.data.batch import Batch, sequence_lengths


def test_a_sample_weighs_its_prompt_its_response_and_the_observations_between_its_turns():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    batch = Batch({"prompt_mask": prompt_mask})
    assert sequence_lengths(batch) == [2, 3]  # before the rollout
    batch.tensors["response_mask"] = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 1, 0]])
    assert sequence_lengths(batch) == [4, 6]
    # a multi-turn episode: the tool's answer (observation_mask) is attended to, though not trained on
    batch.tensors["observation_mask"] = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]])
    assert sequence_lengths(batch) == [4, 8]
