"""dflash.seeding.derive_seed: the three streams (anchors, random-target init, feature noise) get
exactly the seeds the code computed before the helper existed, so no run's numbers change."""

from __future__ import annotations

import zlib

import pytest
import torch

from dflash.model.features import apply_feature_noise
from dflash.model.target import _param_seed
from dflash.run.stages.prefetch import anchor_generator
from dflash.seeding import ANCHORS, FEATURE_NOISE, PARAMS, derive_seed

SEEDS = [0, 1, 7, 1234, 2**31 - 1, 2**62, 2**63 - 1]
KEYS = [0, 1, 5, 999_999, 2**40]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("key", KEYS)
def test_values_equal_the_formulas_the_streams_used(seed, key):
    assert derive_seed(seed, key, salt=ANCHORS) == (seed * 1_000_003 + key) % (2**63)
    assert derive_seed(seed, key + 1, salt=FEATURE_NOISE) == (seed * 7_000_003 + key + 1) % (2**63)
    name = f"model.layers.{key % 40}.mlp.up_proj.weight"
    assert derive_seed(seed, name, salt=PARAMS) == (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)
    assert 0 <= derive_seed(seed, key) < 2**63


def test_pinned_values():
    """Literal values, so a change of the formula (or of a salt) cannot pass by changing both sides."""
    assert derive_seed(7, 5, salt=ANCHORS) == 7_000_026
    assert derive_seed(2**62, 3, salt=ANCHORS) == 4_611_686_018_427_387_907
    assert derive_seed(7, "model.embed_tokens.weight", salt=PARAMS) == 373_643_303
    assert derive_seed(7, 6, salt=FEATURE_NOISE) == 49_000_027


def test_the_streams_use_the_helper():
    assert _param_seed(7, "model.embed_tokens.weight") == 373_643_303
    a, b = anchor_generator(7, 5), torch.Generator().manual_seed(7_000_026)
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    x = torch.ones(1, 3, 4)
    noisy = apply_feature_noise(x, std=0.5, seed=7, batch_id=5)
    gen = torch.Generator().manual_seed(49_000_027)  # rms of ones is 1
    expect = torch.randn(x.shape, generator=gen).mul_(0.5).add_(x)
    assert torch.equal(noisy, expect)


def test_anchor_and_noise_seeds_of_one_batch_differ():
    """Their difference is ``seed * 6_000_000 + 1``: odd, so never 0 mod 2**63."""
    for seed in SEEDS:
        for batch_id in KEYS:
            assert derive_seed(seed, batch_id, salt=ANCHORS) != derive_seed(seed, batch_id + 1, salt=FEATURE_NOISE)
