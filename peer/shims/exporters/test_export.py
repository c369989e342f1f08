# Copied into the unpacked transformers sdist by `make peer-test`. The sdist ships
# tests/test_modeling_common.py but not tests/exporters/, which it imports: torch.export
# tests are therefore not part of the peer run (an empty mixin adds no tests).
class ExportTesterMixin:
    pass
