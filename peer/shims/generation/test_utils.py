# Copied into the unpacked transformers sdist by `make peer-test`. The sdist ships
# tests/test_modeling_common.py but not tests/generation/, which it imports: generate()
# tests are not part of the peer run, and the drivers set all_generative_model_classes = ()
# as upstream's test_generation_tester_mixin_inheritance asks for models without them.
class GenerationTesterMixin:
    pass
