"""``rank_sources``: the slice of the unsharded checkpoint each tensor of a rank model holds (the streamed per-rank
compile reads only these). Checked tensor by tensor against ``shard_model``, which slices a loaded model."""

from __future__ import annotations

import pytest
import torch

from moeforge.model.loader import load_model
from moeforge.model.rank_model import rank_layout, rank_sources, shard_model

CASES = [("tiny-deepseek-v3", 2, 2), ("tiny-deepseek-v3", 2, 1), ("tiny-deepseek-v2", 4, 4), ("tiny-llama", 2, 1),
         ("tiny-llama", 4, 1), ("tiny-qwen3-moe", 2, 2), ("tiny-qwen3-moe", 2, 1), ("tiny-glm4-moe", 2, 1),
         ("tiny-mixtral", 2, 2), ("tiny-deepseek-v4", 2, 1), ("tiny-deepseek-v4", 2, 2)]


@pytest.mark.parametrize(("name", "tp", "ep"), CASES)
def test_every_rank_tensor_is_the_named_slice_of_the_source(name: str, tp: int, ep: int) -> None:
    model = load_model(name).model
    source = dict(model.state_dict())
    for rank in range(tp):
        local, _, _ = shard_model(model, tp, ep, rank)
        where = rank_sources(model.config, rank_layout(model.config, tp, ep, rank), lambda n: tuple(source[n].shape))
        tensors = dict(local.state_dict())
        assert tensors
        for rank_name, tensor in tensors.items():
            piece = where(rank_name)
            assert piece is not None, rank_name
            whole = source[piece.source]
            expected = whole if piece.dim is None else whole.narrow(piece.dim, piece.start, piece.stop - piece.start)
            assert torch.equal(tensor, expected), (rank, rank_name, piece)
        assert where("model.rotary.inv_freq") is None
