"""Our engine on `demo-sparse` (8 full experts, seeded top-2 router) against the dense SmolLM2 in
unmodified transformers: sparse routing must not change the logits (fp32) or the greedy text.

A module of its own so that the 2.5 GB fp32 model is released before the next module loads.
"""

from __future__ import annotations

import pytest
from smollm2 import assert_same_as_dense, assert_same_greedy_as_dense, fp32_llm

from hetmoe.engine.engine import LLM

GREEDY_TOKENS = 12


@pytest.fixture(scope="module")
def sparse_llm(demo_sparse_dir) -> LLM:
    return fp32_llm(demo_sparse_dir)


def test_sparse_logits_match_dense_smollm2(sparse_llm, dense):
    assert sparse_llm.model.config.num_experts_per_tok == 2
    assert_same_as_dense(sparse_llm, dense)


def test_sparse_greedy_text_equals_dense_smollm2(sparse_llm, dense):
    assert_same_greedy_as_dense(sparse_llm, dense, GREEDY_TOKENS)
