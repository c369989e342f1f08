"""transformers' common model tests (ModelTesterMixin) for Llama, on a tiny config."""

import unittest

from tests.test_modeling_common import ModelTesterMixin
from tiny_tester import TinyTester
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)


class LlamaTester(TinyTester):
    def get_config(self):
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
            max_position_embeddings=512, pad_token_id=0,
        )



class LlamaPeerTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (
        LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification,
        LlamaForQuestionAnswering, LlamaForTokenClassification,
    )

    # The sdist lacks tests/generation/ (see peer/shims): no generate() tests here.
    all_generative_model_classes = ()

    def setUp(self):
        self.model_tester = LlamaTester(self)
