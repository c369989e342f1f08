"""transformers' common model tests (ModelTesterMixin) for BERT, on a tiny config."""

import unittest

import torch
from tests.test_modeling_common import ModelTesterMixin, ids_tensor
from tiny_tester import TinyTester
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


class BertTester(TinyTester):
    def get_config(self):
        return BertConfig(
            vocab_size=self.vocab_size, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=37, max_position_embeddings=512,
            type_vocab_size=16,
        )

    def inputs(self):
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], 16)
        return {**super().inputs(), "token_type_ids": token_type_ids}


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
