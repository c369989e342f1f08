"""transformers' common model tests (ModelTesterMixin) for GPT-2, on a tiny config."""

import unittest

from tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from transformers import (
    GPT2Config,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
)


class GPT2Tester:
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
        return GPT2Config(
            vocab_size=self.vocab_size, n_embd=32, n_layer=2, n_head=4, n_inner=37,
            n_positions=512, pad_token_id=self.vocab_size - 1, bos_token_id=self.vocab_size - 1,
            eos_token_id=self.vocab_size - 1,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


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

