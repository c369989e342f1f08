"""transformers' common model tests (ModelTesterMixin) for BERT, on a tiny config."""

import unittest

import torch
from tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)


class BertTester:
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
        return BertConfig(
            vocab_size=self.vocab_size, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=37, max_position_embeddings=512,
            type_vocab_size=16,
        )

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], 16)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        inputs = {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": mask}
        return self.get_config(), inputs


class BertPeerTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (
        BertModel, BertForMaskedLM, BertForNextSentencePrediction, BertForPreTraining,
        BertForQuestionAnswering, BertForSequenceClassification, BertForTokenClassification,
    )

    def setUp(self):
        self.model_tester = BertTester(self)

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        # As transformers' own BertModelTest: the pre-training head's loss needs both labels.
        inputs = super()._prepare_for_class(inputs_dict, model_class, return_labels)
        if return_labels and model_class is BertForPreTraining:
            size = (self.model_tester.batch_size, self.model_tester.seq_length)
            inputs["labels"] = torch.zeros(size, dtype=torch.long)
            inputs["next_sentence_label"] = torch.zeros(self.model_tester.batch_size,
                                                        dtype=torch.long)
        return inputs
