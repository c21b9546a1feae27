"""``engine.training.parallel.dtensor.flat_range_chunks``: a flat range of a row-major tensor (ZeRO-1's piece of
a parameter's moment) as at most three rectangles that tile exactly that range, each a view of the piece."""
from __future__ import annotations

import itertools

import torch

from engine.training.parallel.dtensor import flat_range_chunks


def test_flat_ranges_tile_into_at_most_three_rectangles():
    for shape in ((5, 7), (1, 9), (6, 1), (11,)):
        full = torch.arange(float(torch.Size(shape).numel())).view(shape)
        n = full.numel()
        for start, stop in itertools.combinations(range(n + 1), 2):
            piece = full.reshape(-1)[start:stop].clone()
            chunks = flat_range_chunks(full.shape, start, piece)
            covered = torch.zeros(shape)
            for block, chunk in chunks._chunks():
                where = tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
                assert torch.equal(block, full[where]), (shape, start, stop)
                assert block.data_ptr() >= piece.data_ptr()  # a view of the piece, not a copy
                covered[where] += 1
            want = torch.zeros(n)
            want[start:stop] = 1
            assert torch.equal(covered.reshape(-1), want), (shape, start, stop)
            assert len(chunks.__create_chunk_list__()) <= 3
    assert flat_range_chunks((5, 7), 4, torch.empty(0)).__create_chunk_list__() == []  # a rank without a piece
