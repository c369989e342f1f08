"""What a load does on the side, seen at its source (``_loading/draws.py``,
``_loading/observe.py``): random draws where they happen (also inside ``fork_rng``, in thread
pools, never on the meta device), warnings replayed through the once-registry plain Python uses,
log records recorded below the level in force and replayed through the levels in force at the hit.
Real models, in this process."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import logging
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from overmind_lab._common.fingerprint import compare
from overmind_lab._loading.draws import Draws
from overmind_lab._loading.observe import Capture, Observed, replay
from tests.conftest import save_tiny_llama


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama"))


def _drawn(fn: Callable[[], Any], *, ops: bool = True) -> tuple[Any, list[str]]:
    with Draws(ops=ops) as draws:
        result = fn()
    return result, draws.drawn


# -- Draws: what it sees ------------------------------------------------------------------
@pytest.mark.parametrize("ops", [True, False], ids=["ops", "setters"])
def test_a_draw_inside_fork_rng_is_seen_though_the_state_is_put_back(ops: bool) -> None:
    before = torch.get_rng_state()

    def hidden() -> torch.Tensor:
        with torch.random.fork_rng():
            return torch.randn(4)

    _, drawn = _drawn(hidden, ops=ops)
    assert torch.equal(before, torch.get_rng_state())
    assert drawn == ["torch"]

    def quiet() -> None:
        with torch.random.fork_rng():
            torch.ones(2)

    assert _drawn(quiet, ops=ops)[1] == []  # put back, nothing drawn: nothing seen


@pytest.mark.parametrize("ops", [True, False], ids=["ops", "setters"])
def test_draws_hidden_by_a_state_put_back_are_seen_in_every_generator(ops: bool) -> None:
    import random

    import numpy as np

    def hide_random() -> None:
        state = random.getstate()
        random.random()
        random.setstate(state)

    def hide_numpy() -> None:
        state = np.random.get_state()
        np.random.rand()
        np.random.set_state(state)

    def hide_torch_in_a_thread() -> None:
        import threading

        thread = threading.Thread(target=lambda: torch.random.fork_rng().__enter__()
                                  or torch.rand(2))
        state = torch.get_rng_state()
        thread.start()
        thread.join()
        torch.set_rng_state(state)

    assert _drawn(hide_random, ops=ops)[1] == ["random"]
    assert _drawn(hide_numpy, ops=ops)[1] == ["numpy"]
    assert _drawn(hide_torch_in_a_thread, ops=ops)[1] == ["torch"]


def test_a_reseeded_generator_counts_as_drawn() -> None:
    state = torch.get_rng_state()
    try:
        assert _drawn(lambda: torch.manual_seed(7), ops=False)[1] == ["torch"]
    finally:
        torch.set_rng_state(state)


@pytest.mark.parametrize("draw", [
    lambda: torch.empty(8).normal_(),
    lambda: torch.empty(8).uniform_(),
    lambda: torch.nn.init.kaiming_uniform_(torch.empty(4, 4)),
    lambda: torch.randperm(5),
    lambda: torch.bernoulli(torch.full((4,), 0.5)),
    lambda: torch.nn.functional.dropout(torch.ones(8), 0.5, training=True),
    lambda: torch.multinomial(torch.ones(4), 2),
], ids=["normal_", "uniform_", "kaiming", "randperm", "bernoulli", "dropout", "multinomial"])
def test_each_kind_of_torch_draw_is_seen(draw: Callable[[], Any]) -> None:
    def hidden() -> Any:
        with torch.random.fork_rng():
            return draw()

    assert _drawn(hidden)[1] == ["torch"]


@pytest.mark.parametrize("quiet", [
    lambda: torch.empty(8, device="meta").normal_(),
    lambda: torch.randn(3, 3, device="meta"),
    lambda: torch.nn.Linear(4, 4, device="meta"),
    lambda: torch.nn.functional.dropout(torch.ones(8), 0.5, training=False),
    lambda: torch.nn.functional.scaled_dot_product_attention(
        torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4)),
    lambda: torch.ones(3) @ torch.ones(3),
], ids=["meta-normal_", "meta-randn", "meta-linear", "eval-dropout", "sdpa-no-dropout",
        "matmul"])
def test_what_draws_nothing_is_not_a_draw(quiet: Callable[[], Any]) -> None:
    assert _drawn(quiet)[1] == []


def test_an_explicit_generator_is_named_apart() -> None:
    generator = torch.Generator().manual_seed(3)
    assert _drawn(lambda: torch.randn(3, generator=generator))[1] == ["torch.Generator"]
    default = torch.default_generator
    with torch.random.fork_rng():
        assert _drawn(lambda: torch.randn(3, generator=default))[1] == ["torch"]


def test_random_and_numpy_are_seen_by_their_state() -> None:
    import random

    import numpy as np

    assert _drawn(random.random)[1] == ["random"]
    assert _drawn(np.random.rand)[1] == ["numpy"]
    state = random.getstate()
    assert _drawn(lambda: random.setstate(state))[1] == []


def test_a_draw_in_a_thread_pool_is_seen() -> None:
    def job() -> torch.Tensor:
        with torch.random.fork_rng():
            return torch.randn(3)

    def pooled() -> list[torch.Tensor]:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda _: job(), range(4)))

    assert _drawn(pooled)[1] == ["torch"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # no Draws: the pool is plain
        assert len(pool.submit(job).result()) == 3


def test_errors_of_the_code_inside_pass_unchanged() -> None:
    def broken() -> None:
        torch.ones(2) @ torch.ones(3)

    with pytest.raises(RuntimeError, match="size mismatch|shapes cannot be multiplied|inconsist"):
        with Draws():
            broken()
    assert _get_current_dispatch_mode() is None


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_users_dispatch_modes_keep_working_inside_and_around() -> None:
    with _Counting() as outer:
        with Draws() as draws:
            with _Counting() as inner, torch.random.fork_rng():
                torch.randn(3).add_(1)
        assert _get_current_dispatch_mode() is outer
    assert inner.calls == 2 and outer.calls == 2
    assert draws.drawn == ["torch"]
    assert _get_current_dispatch_mode() is None


def test_higher_order_operators_pass_through() -> None:
    def branch(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(bool(x.sum() > 0), lambda x: x + 1, lambda x: x - 1, (x,))

    with Draws(ops=True) as draws:
        assert torch.equal(branch(torch.ones(3)), torch.full((3,), 2.0))
    assert draws.drawn == []


def test_a_mode_the_code_leaves_behind_stays_as_it_was() -> None:
    leaked = _Counting()
    with Draws(ops=True) as draws:
        leaked.__enter__()
    try:
        assert _get_current_dispatch_mode() is leaked
        assert torch._C._len_torch_dispatch_stack() == 1  # ours is gone from under it
        assert draws.drawn == []
    finally:
        leaked.__exit__(None, None, None)
    assert _get_current_dispatch_mode() is None


def test_captures_and_draws_in_two_threads_at_once_leave_no_hook(tmp_path: Path) -> None:
    import threading

    lib = _module(tmp_path, LOADERS)
    both_in, first_out = threading.Barrier(2), threading.Event()
    found: dict[str, list[str]] = {}

    def cold(name: str, leave_first: bool) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Draws(ops=True) as draws, Capture(emit=False) as capture:
                both_in.wait()
                if not leave_first:
                    first_out.wait()
                lib.load()
        if leave_first:
            first_out.set()
        found[name] = [w["message"] for w in capture.observed.warnings] + draws.drawn

    plain = (warnings.warn, logging.Logger.handle, torch.set_rng_state)
    threads = [threading.Thread(target=cold, args=(n, n == "a")) for n in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (warnings.warn, logging.Logger.handle, torch.set_rng_state) == plain
    assert found["a"] and found["b"]  # each saw the loads' warnings (both: no thread told apart)
    assert not torch.utils._python_dispatch.is_in_torch_dispatch_mode()


def test_the_hooks_are_gone_after_the_last_exit() -> None:
    import random

    def hooks() -> tuple[Any, ...]:
        return (warnings.warn, warnings.warn_explicit, logging.Logger.isEnabledFor,
                logging.Logger.handle, concurrent.futures.ThreadPoolExecutor.submit,
                torch.set_rng_state, torch.random.manual_seed, random.setstate)

    plain = hooks()
    with Draws(ops=True), Capture(), Draws():
        assert all(a is not b for a, b in zip(hooks(), plain, strict=True))
    assert hooks() == plain
    with Draws():
        assert concurrent.futures.ThreadPoolExecutor.submit is plain[4]  # pools: ops only
    assert hooks() == plain


# -- Draws on real loads ------------------------------------------------------------------
OPS = pytest.mark.parametrize("ops", [True, False], ids=["ops", "setters"])


@OPS
@pytest.mark.parametrize("low_cpu_mem_usage", [True, False])
def test_a_diffusers_unet_load_draws_nothing_and_is_unchanged(
        tiny_unet_dir: Path, low_cpu_mem_usage: bool, ops: bool) -> None:
    from diffusers import UNet2DConditionModel

    def load() -> Any:
        return UNet2DConditionModel.from_pretrained(tiny_unet_dir,
                                                    low_cpu_mem_usage=low_cpu_mem_usage)

    plain = load()
    watched, drawn = _drawn(load, ops=ops)
    assert drawn == []
    assert compare(watched, plain) is None


@OPS
@pytest.mark.parametrize("options", [{}, {"low_cpu_mem_usage": False}, {"device_map": "cpu"},
                                     {"dtype": torch.float16}], ids=str)
def test_a_transformers_load_draws_nothing_and_is_unchanged(llama_dir: Path, ops: bool,
                                                            options: dict[str, Any]) -> None:
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM.from_pretrained(llama_dir, **options)
    watched, drawn = _drawn(lambda: LlamaForCausalLM.from_pretrained(llama_dir, **options),
                            ops=ops)
    assert drawn == []  # built on the meta device: its init draws nothing real
    assert compare(watched, plain) is None


@OPS
def test_a_load_with_a_head_missing_from_the_checkpoint_draws(llama_dir: Path,
                                                              ops: bool) -> None:
    from transformers import LlamaForSequenceClassification

    def load() -> Any:
        return LlamaForSequenceClassification.from_pretrained(llama_dir, num_labels=3)

    torch.manual_seed(5)
    plain = load()
    torch.manual_seed(5)
    watched, drawn = _drawn(load, ops=ops)
    assert drawn == ["torch"]
    assert compare(watched, plain) is None

    def hidden() -> Any:
        with torch.random.fork_rng():
            return load()

    assert _drawn(hidden, ops=ops)[1] == ["torch"]


# -- warnings -----------------------------------------------------------------------------
_names = itertools.count()


def _module(tmp_path: Path, source: str) -> ModuleType:
    """A real module of its own (its own ``__warningregistry__``)."""
    name = f"observe_case_{next(_names)}"
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


LOADERS = '''
import logging, warnings
from warnings import warn as early_warn

def load(n=1):
    for _ in range(n):
        warnings.warn("a library says this once per location", UserWarning)
    return 1

def deprecated():
    warnings.warn("called from the caller's line", FutureWarning, stacklevel=2)

def early():
    early_warn("bound before any wrapper", UserWarning)

def explicit():
    warnings.warn_explicit("given its place", UserWarning, __file__, 7)

def silenced():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.warn("the library hides this", UserWarning)

def caught():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("the library keeps this for itself", UserWarning)
    return len(seen)

def noisy(tag):
    logger = logging.getLogger("transformers.observe_case")
    logger.info("info %s", tag)
    warnings.warn(f"between {tag}", UserWarning)
    logger.warning("warning %s", tag)
'''


@pytest.fixture
def shown(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Warnings displayed, under the "default" action (once per location), counted without
    ``catch_warnings(record=True)`` (which would reset every once-registry)."""
    out: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        monkeypatch.setattr(warnings, "showwarning",
                            lambda message, category, filename, lineno, *a, **k:
                            out.append(f"{category.__name__}: {message} @{Path(filename).name}"))
        yield out


def test_a_once_per_location_warning_stays_once_across_hits_and_plain_loads(
        tmp_path: Path, shown: list[str]) -> None:
    lib = _module(tmp_path, LOADERS)
    with Capture() as capture:
        lib.load(3)  # a warning in a loop: recorded as one item, shown once
    assert len(shown) == 1 and capture.observed.warnings[0]["count"] == 3
    assert capture.observed.warnings[0]["module"] == lib.__name__
    for _ in range(5):
        replay(capture.observed)
    lib.load()
    assert len(shown) == 1, shown
    lib.__warningregistry__.clear()  # as a new process: the first hit shows it, once
    for _ in range(3):
        replay(capture.observed)
        lib.load()
    assert shown == [shown[0]] * 2


PROPERTY_LIB = """
import warnings

def f0():
    warnings.warn("zero", UserWarning)

def f1():
    warnings.warn("one", UserWarning)

def f2(n=2):
    for _ in range(n):
        warnings.warn("two", FutureWarning)
"""


@given(st.lists(st.tuples(st.sampled_from(["plain", "cold", "hit", "new process"]),
                          st.integers(0, 2)), max_size=12))
@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_hits_show_what_plain_loads_would_in_any_order(
        tmp_path: Path, shown: list[str], steps: list[tuple[str, int]]) -> None:
    """Property: any sequence of cold loads, hits and plain loads of warning loaders shows,
    under the default action, what the same sequence of plain loads shows."""
    lib = _module(tmp_path, PROPERTY_LIB)
    loaders = [lib.f0, lib.f1, lib.f2]
    recorded: dict[int, Observed] = {}
    expected: list[str] = []
    shown.clear()
    seen: set[int] = set()  # the locations a plain process would have shown by now
    for action, i in steps:
        if action == "new process":
            lib.__dict__.pop("__warningregistry__", None)
            seen.clear()
            continue
        if action == "hit" and i not in recorded:
            continue
        if i not in seen:
            expected.append(f"{['UserWarning', 'UserWarning', 'FutureWarning'][i]}: "
                            f"{['zero', 'one', 'two'][i]} @{Path(lib.__file__).name}")
            seen.add(i)
        if action == "plain":
            loaders[i]()
        elif action == "cold":
            with Capture() as capture:
                loaders[i]()
            recorded[i] = capture.observed
        else:
            replay(recorded[i])
    assert shown == expected


def test_a_warning_the_registry_held_back_at_the_cold_load_is_recorded(
        tmp_path: Path, shown: list[str]) -> None:
    lib = _module(tmp_path, LOADERS)
    lib.load()
    with Capture() as capture:
        lib.load()
    assert len(shown) == 1  # as plain: held back
    assert [w["message"] for w in capture.observed.warnings] == [
        "a library says this once per location"]


def test_a_warning_ignored_at_the_cold_load_shows_under_the_filters_of_the_hit(
        tmp_path: Path, shown: list[str]) -> None:
    lib = _module(tmp_path, LOADERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Capture() as capture:
            lib.load()
    assert shown == []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=lib.__name__)  # matched by module, as plain
        replay(capture.observed)
    assert shown == []
    replay(capture.observed)
    assert len(shown) == 1


def test_what_the_user_sees_at_the_cold_load_is_what_plain_shows(
        tmp_path: Path, shown: list[str]) -> None:
    lib = _module(tmp_path, LOADERS)
    lib.deprecated()
    lib.early()
    lib.explicit()
    plain = list(shown)
    shown.clear()
    lib.__warningregistry__.clear()
    sys.modules[__name__].__dict__.pop("__warningregistry__", None)
    with Capture() as capture:
        lib.deprecated()
        lib.early()
        lib.explicit()
    assert shown == plain and len(plain) == 3
    deprecated, early, explicit = capture.observed.warnings
    assert explicit["module"] == str(Path(lib.__file__).with_suffix(""))
    assert (deprecated["module"], Path(deprecated["filename"]).name) == (
        __name__, Path(__file__).name)  # the caller's line, as stacklevel=2 says
    assert early["module"] == lib.__name__  # came by the display, not by a wrapper


def test_what_the_load_silences_itself_is_not_recorded(tmp_path: Path,
                                                       shown: list[str]) -> None:
    lib = _module(tmp_path, LOADERS)
    with Capture() as capture:
        lib.silenced()
        assert lib.caught() == 1
    assert shown == [] and capture.observed.warnings == []


def test_an_only_recording_capture_shows_nothing(tmp_path: Path, shown: list[str],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    lib = _module(tmp_path, LOADERS)
    with caplog.at_level(logging.INFO, logger="transformers"), Capture(emit=False) as capture:
        lib.noisy("quiet")
        lib.early()
    assert shown == [] and caplog.records == []
    assert len(capture.observed.warnings) == 2 and len(capture.observed.logs) == 2


@pytest.mark.skipif(sys.version_info < (3, 12), reason="skip_file_prefixes is 3.12+")
def test_skip_file_prefixes_attributes_as_plain(tmp_path: Path, shown: list[str]) -> None:
    lib = _module(tmp_path, "import warnings, os\n"
                            "def load():\n"
                            "    warnings.warn('x', UserWarning, "
                            "skip_file_prefixes=(os.path.dirname(__file__),))\n")
    lib.load()
    plain = list(shown)
    sys.modules[__name__].__dict__.pop("__warningregistry__", None)
    shown.clear()
    with Capture() as capture:
        lib.load()
    assert shown == plain
    assert capture.observed.warnings[0]["module"] == __name__


# -- log records --------------------------------------------------------------------------
class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(f"{record.levelname} {record.getMessage()} {record.filename}")


@pytest.fixture
def library_logs() -> Iterator[_Keep]:
    """What a user's handler on ``transformers`` sees, at transformers' default verbosity."""
    import transformers

    logger = logging.getLogger("transformers")
    handler = _Keep()
    logger.addHandler(handler)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    try:
        yield handler
    finally:
        transformers.logging.set_verbosity(verbosity)
        logger.removeHandler(handler)


def test_a_cold_load_under_error_verbosity_records_what_a_plain_load_would_say(
        llama_dir: Path, library_logs: _Keep) -> None:
    import transformers
    from transformers import LlamaModel  # lm_head.weight: an unexpected key, reported

    LlamaModel.from_pretrained(llama_dir)
    plain = list(library_logs.seen)
    assert any("UNEXPECTED" in line for line in plain), plain
    library_logs.seen.clear()
    transformers.logging.set_verbosity_error()
    with Capture() as capture:
        LlamaModel.from_pretrained(llama_dir)
    assert library_logs.seen == []  # the user saw what a plain load at this verbosity shows
    replay(capture.observed)
    assert library_logs.seen == []  # a hit under the same verbosity: silent too
    transformers.logging.set_verbosity_warning()
    replay(capture.observed)
    assert library_logs.seen == plain


def test_a_cold_load_at_default_verbosity_is_silent_in_a_hit_under_error_verbosity(
        llama_dir: Path, library_logs: _Keep) -> None:
    import transformers
    from transformers import LlamaModel

    with Capture() as capture:
        LlamaModel.from_pretrained(llama_dir)
    cold = list(library_logs.seen)
    assert any("UNEXPECTED" in line for line in cold)
    library_logs.seen.clear()
    transformers.logging.set_verbosity_error()
    replay(capture.observed)
    assert library_logs.seen == []
    transformers.logging.set_verbosity_info()
    replay(capture.observed)
    assert [s for s in library_logs.seen if s.startswith("INFO")]  # recorded below the level
    assert [s for s in library_logs.seen if s.startswith("WARNING")] == cold


def test_records_below_the_level_reach_no_handler_of_the_user(library_logs: _Keep) -> None:
    child = logging.getLogger("transformers.observe_case.own")
    own = _Keep()
    child.addHandler(own)
    child.propagate = False  # a logger of its own: no capture sees it, its handler stays plain
    try:
        with Capture() as capture:
            logging.getLogger("transformers.observe_case").debug("debug only")
            child.info("own info")
            child.warning("own warning")
    finally:
        child.removeHandler(own)
        child.propagate = True
    assert library_logs.seen == [] and own.seen == ["WARNING own warning test_observe.py"]
    assert [r["msg"] for r in capture.observed.logs] == ["debug only"]


def test_a_library_asking_its_logger_gets_the_true_answer(library_logs: _Keep) -> None:
    logger = logging.getLogger("transformers.observe_case")
    with Capture():
        assert not logger.isEnabledFor(logging.INFO)  # transformers' load report asks this
        assert logger.isEnabledFor(logging.WARNING)


def test_warnings_and_records_replay_in_their_order(tmp_path: Path, shown: list[str],
                                                    library_logs: _Keep) -> None:
    lib = _module(tmp_path, LOADERS)
    order: list[str] = []
    library_logs.emit = lambda record: order.append(record.getMessage())  # type: ignore[method-assign]
    with Capture() as capture:
        lib.noisy("cold")
    cold_shown = list(shown)
    lib.__warningregistry__.clear()
    shown.clear()
    warnings.showwarning = lambda message, *a, **k: order.append(str(message))  # type: ignore[assignment]
    order.clear()
    replay(capture.observed)
    assert order == ["between cold", "warning cold"] and len(cold_shown) == 1


def test_warning_once_stays_once_between_hits_and_plain_loads(library_logs: _Keep) -> None:
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers.observe_case")
    message = f"said once per process {next(_names)}"
    with Capture() as capture:
        logger.warning_once(message)
    assert [r.get("once") for r in capture.observed.logs] == ["warning_once"]
    for _ in range(3):
        replay(capture.observed)
        logger.warning_once(message)
    assert len(library_logs.seen) == 1
    hf_logging.logging.Logger.warning_once.cache_clear()  # as a new process
    replay(capture.observed)
    logger.warning_once(message)
    assert library_logs.seen == [library_logs.seen[0]] * 2


def test_entries_recorded_before_the_source_was_kept_replay() -> None:
    old = Observed.from_json({
        "warnings": [{"category": "builtins.UserWarning", "message": "old entry",
                      "filename": "/nowhere/lib.py", "lineno": 3}],
        "logs": [{"name": "transformers.observe_case", "levelno": 30, "levelname": "WARNING",
                  "msg": "old record", "pathname": "/nowhere/lib.py", "lineno": 4,
                  "funcName": "f"}]})
    with pytest.warns(UserWarning, match="old entry"):
        replay(old)
