"""transformers' common model tests (ModelTesterMixin) for Llama, on a tiny config."""

import unittest

from tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
)


class LlamaTester:
    def __init__(self, parent, batch_size=2, seq_length=7):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.vocab_size = 99
        self.num_labels = 3
        self.type_sequence_label_size = 2
        self.is_training = True
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.intermediate_size = 37

    def get_config(self):
        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
            max_position_embeddings=512, pad_token_id=0,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


class LlamaPeerTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (
        LlamaModel, LlamaForCausalLM, LlamaForSequenceClassification,
        LlamaForQuestionAnswering, LlamaForTokenClassification,
    )

    # The sdist lacks tests/generation/ (see peer/shims): no generate() tests here.
    all_generative_model_classes = ()

    def setUp(self):
        self.model_tester = LlamaTester(self)
