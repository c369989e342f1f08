"""The fingerprint (``overmind_lab/_common/fingerprint.py``): equal for equal objects,
different, at a named path, for every kind of difference a user can observe, and never
raising, whatever the tensor kind."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch

from overmind_lab._common.fingerprint import compare, difference, differences, fingerprint
from tests.loaders import hooked_model, layouts


def _odd_tensors() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta / deprecated tensor kinds
        return {
            "conj": torch.arange(3.0).to(torch.complex64).conj(),
            "neg": torch.arange(3.0).to(torch.complex64).conj().imag,
            "coo": torch.eye(3).to_sparse(),
            "csr": torch.eye(3).to_sparse_csr(),
            "q": torch.quantize_per_tensor(torch.arange(4.0), 0.1, 3, torch.qint8),
            "qc": torch.quantize_per_channel(torch.ones(2, 4), torch.tensor([0.1, 0.2]),
                                             torch.tensor([0, 1]), 0, torch.quint8),
            "meta": torch.empty(3, device="meta"),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "f8": torch.arange(4.0).to(torch.float8_e4m3fn),
            "bf": torch.arange(2.0).bfloat16(),
            "expanded": torch.ones(1, 3).expand(4, 3),
            "channels_last": torch.ones(1, 2, 3, 3).to(memory_format=torch.channels_last),
            "inference": _inference(),
        }


def _inference() -> torch.Tensor:
    with torch.inference_mode():
        return torch.ones(2)


def test_equal_objects_have_equal_fingerprints() -> None:
    assert compare(_odd_tensors(), _odd_tensors()) is None
    first = layouts()
    assert compare(copy.deepcopy(first), first) is None
    # two calls register their hooks with other ids of torch's counter: observable
    assert "hooked._forward_hooks: " in str(compare(layouts(), first))
    assert "_forward_hooks: " in str(compare(hooked_model(), hooked_model()))


def test_it_never_raises_and_reads_every_tensor_kind() -> None:
    found = fingerprint(_odd_tensors())
    unreadable = {k: v for k, v in found.items() if "unreadable" in v}
    # the one fact torch itself refuses: the sizes of a strided nested tensor
    assert set(unreadable) == {"['nested'] shape"}, unreadable
    assert "NameError" not in repr(found) and "AttributeError" not in repr(found)
    assert found["['q'] q"].startswith("scale 0.1")
    assert found["['coo'].<values> storage"].startswith("storage")
    assert found["['conj'] conj"] == "True" and found["['neg'] neg"] == "True"
    assert found["['expanded'] stride"] == "[0, 1]"


class _Exploding:
    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError("boom")

    __slots__ = ()


def test_hostile_objects_are_recorded_not_raised() -> None:
    found = fingerprint({"x": _Exploding()})
    assert "not picklable: RuntimeError" in found["['x']"]


def _named(obj: Any, change: Any) -> str | None:
    other = copy.deepcopy(obj)
    change(other)
    return difference(fingerprint(other), fingerprint(obj))


def test_a_difference_names_its_path_and_what_differs() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))

    def untie(m: torch.nn.Sequential) -> None:
        m[1].weight = m[0].weight

    def train(m: torch.nn.Sequential) -> None:
        m[1].train(False)

    def offset(m: torch.nn.Sequential) -> None:
        with torch.no_grad():
            m[0].bias = torch.nn.Parameter(torch.cat([torch.zeros(1), m[0].bias])[1:])

    def flag(m: torch.nn.Sequential) -> None:
        m[0].weight.requires_grad_(False)

    def attribute(m: torch.nn.Sequential) -> None:
        m[0].scale = 2.0

    def hook(m: torch.nn.Sequential) -> None:
        m[1].register_forward_hook(lambda *a: None)

    assert _named(model, untie).startswith("[1].weight: ")
    assert _named(model, train).startswith("[1]: ")
    assert _named(model, offset) == "[0].bias offset: 1 vs 0"
    assert _named(model, flag) == "[0].weight requires_grad: False vs True"
    assert _named(model, attribute) == (
        "[0] attrs: ['scale'] only in the warm result, [] only in the plain")
    assert _named(model, hook).startswith("[1]._forward_hooks: ")


def test_alignment_and_sharing_are_seen() -> None:
    base = torch.arange(32, dtype=torch.float32)
    apart = {"a": base[:16].clone(), "b": base[16:].clone()}
    shared = {"a": base[:16], "b": base[16:]}  # one storage, the second at an offset
    found = list(differences(fingerprint(shared), fingerprint(apart)))
    assert "['b'] offset: 16 vs 0" in found, found
    assert any(d.startswith("['b'] storage: storage of ['a'] vs storage 64 bytes")
               for d in found), found
    buffer = bytearray(64 + 16)
    at = [torch.frombuffer(buffer, dtype=torch.uint8, offset=i, count=16) for i in (0, 8)]
    moved = difference(fingerprint({"t": at[1]}), fingerprint({"t": at[0]}))
    assert moved == "['t'] data_ptr%16: 8 vs 0", moved


def test_tokenizer_ids_count() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {c: i for i, c in enumerate("abcdefgh ")}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="a"))
    tok.add_special_tokens(["<|im_start|>"])
    renumbered = tokenizers.Tokenizer(tokenizers.models.BPE(
        {**vocab, "<|im_start|>": 3}, [], unk_token="a"))
    renumbered.add_special_tokens(["<|im_start|>"])
    found = difference(fingerprint(renumbered), fingerprint(tok))
    assert found is not None and "tokenizer" in found
    assert compare(pickle.loads(pickle.dumps(tok)), tok) is None
