"""Sampler: greedy, top-k / top-p filtering, seeded reproducibility."""
import torch

from engine.sampler import apply_top_k_top_p, greedy, sample
from engine.sampling_params import SamplingParams

LOGITS = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])


def kept(logits):
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_and_top_p_filters():
    assert kept(apply_top_k_top_p(LOGITS, 2, 1.0)) == [1, 3]
    assert kept(apply_top_k_top_p(LOGITS, 0, 1.0)) == [0, 1, 2, 3, 4]
    p = LOGITS.softmax(-1)  # sorted: 0.64, 0.24, 0.09, ...
    assert kept(apply_top_k_top_p(LOGITS, 0, float(p[1]) - 0.01)) == [1]
    assert kept(apply_top_k_top_p(LOGITS, 0, float(p[1]) + 0.01)) == [1, 3]
    assert kept(apply_top_k_top_p(LOGITS, 0, 0.95)) == [1, 2, 3]


def test_greedy_and_seeded_sampling():
    assert sample(LOGITS, SamplingParams(temperature=0), None) == 1
    params = SamplingParams(temperature=1.0, top_k=3)
    draw = lambda seed: [sample(LOGITS, params, g) for g in [torch.Generator().manual_seed(seed)] for _ in range(50)]
    assert draw(1) == draw(1) and set(draw(1)) <= {1, 2, 3} and len(set(draw(1))) > 1


def test_greedy_rows_equal_argmax_first_maximum():
    g = torch.Generator().manual_seed(0)
    for vocab in (1, 5, 255, 256, 257, 32000):
        logits = torch.randn(7, vocab, generator=g)
        logits[1] = -torch.inf  # an all -inf row: index 0, as argmax
        if vocab > 300:  # ties across chunks and inside one: the first maximum wins
            logits[2, [3, 299, 280]] = 100.0
            logits[3, [290, 257]] = 100.0
        assert torch.equal(greedy(logits), logits.argmax(-1)), vocab
    assert greedy(torch.randn(0, 32000)).shape == (0,)
