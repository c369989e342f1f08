"""What the three drivers' model testers share: the tiny sizes ModelTesterMixin reads and
the common inputs. Each driver adds ``get_config`` for its architecture."""

from tests.test_modeling_common import ids_tensor, random_attention_mask


class TinyTester:
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
        raise NotImplementedError

    def inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return {"input_ids": input_ids, "attention_mask": mask}

    def prepare_config_and_inputs_for_common(self):
        return self.get_config(), self.inputs()
