"""transformers' common model tests (ModelTesterMixin) for GPT-2, on a tiny config."""

import unittest

from tests.test_modeling_common import ModelTesterMixin
from tiny_tester import TinyTester
from transformers import (
    GPT2Config,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
)


class GPT2Tester(TinyTester):
    def get_config(self):
        return GPT2Config(
            vocab_size=self.vocab_size, n_embd=32, n_layer=2, n_head=4, n_inner=37,
            n_positions=512, pad_token_id=self.vocab_size - 1, bos_token_id=self.vocab_size - 1,
            eos_token_id=self.vocab_size - 1,
        )



class GPT2PeerTest(ModelTesterMixin, unittest.TestCase):
    # GPT2DoubleHeadsModel needs mc_token_ids inputs of its own: left out.
    all_model_classes = (
        GPT2Model, GPT2LMHeadModel, GPT2ForSequenceClassification,
        GPT2ForQuestionAnswering, GPT2ForTokenClassification,
    )

    # The sdist lacks tests/generation/ (see peer/shims): no generate() tests here.
    all_generative_model_classes = ()

    def setUp(self):
        self.model_tester = GPT2Tester(self)

