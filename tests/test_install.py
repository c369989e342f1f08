"""The distribution as a package index gets it, installed the way a user installs it.

The ``dist`` fixture runs `make dist-files` (what `make dist` runs after `make install`) into
a folder of its own: an sdist of the checkout (the prebuilt JupyterLab extension inside) and,
for every supported CPython (Note [Supported Pythons] in pyproject.toml) whose interpreter is
here, a wheel built by that Python from the unpacked sdist (which must not need Node.js: CMake
finds the extension up to date), repaired by auditwheel to a manylinux tag. A version whose
interpreter is missing is skipped here; `make test` fails before it gets this far (its
``pythons`` prerequisite). The wheels then go into brand-new venvs:

- for every supported Python, a bare one (``pip install`` of the wheel, which resolves dill and
  psutil from the package index, as a user's would): every module compiles and imports but
  those of extras, the CLI answers, every feature that needs an extra says which, and no
  daemon is started;
- for this Python (the one with torch here), a full one whose dependencies are this test
  environment's own packages (Note [A venv that downloads nothing]): the Jupyter commands,
  the kernelspec, a cold and a warm load in two processes on a private daemon, and
  ``pip uninstall``;
- one that runs ``overmind-lab bench PATH`` on a tiny model folder (the benchmark suite,
  ``benchmarks/``, is not in the wheel).

The build venvs (build/dist-env/, kept) and the bare venvs get their packages from the index.
"""

from __future__ import annotations

import email.parser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

from overmind_lab import Client

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(PY).parent
#: The tag every repaired wheel must carry (Note [Portable native module] in
#: native/portable.cpp): glibc 2.24 and libstdc++ of GCC 6, as `make dist` asks auditwheel.
PLAT = "manylinux_2_24_x86_64"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
#: Note [Supported Pythons]: the versions of pyproject.toml's classifiers.
SUPPORTED = [c.rpartition(" :: ")[2] for c in PYPROJECT["project"]["classifiers"]
             if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
#: This interpreter's version: the one whose venv gets this environment's packages.
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]


def run(cmd: list[str | Path], *, env: dict[str, str] | None = None, check: bool = True,
        cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout}"
                             f"\n--- stderr\n{proc.stderr}")
    return proc


def plain(proc: subprocess.CompletedProcess[str]) -> str:
    """Its stdout and stderr without terminal colours."""
    return re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)


def the_one(paths: Iterator[Path]) -> Path:
    found = list(paths)
    assert len(found) == 1, found
    return found[0]


def make(*args: str, check: bool = True, timeout: float = 300
         ) -> subprocess.CompletedProcess[str]:
    """`make ARGS` in the checkout, with this interpreter as the Makefile's ``PY``."""
    return run(["make", "-s", "--no-print-directory", "-C", REPO, f"PY={PY}", *args],
               check=check, timeout=timeout)


def make_pythons(*args: str) -> tuple[dict[str, Path], list[str]]:
    """`make pythons`: the versions it found, with their interpreters, and those missing."""
    listed = make("pythons", *args, check=False)
    found = dict(re.findall(r"(?m)^(3\.\d+) (\S+)$", listed.stdout))
    missing = re.findall(r"(?m)^make: Python (3\.\d+) is missing", listed.stderr)
    assert (listed.returncode == 0) == (not missing), listed
    return {v: Path(p) for v, p in found.items()}, missing


@pytest.fixture(scope="module")
def interpreters() -> dict[str, Path]:
    """The supported versions whose interpreter `make pythons` finds here, and where."""
    return make_pythons()[0]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory,
         interpreters: dict[str, Path]) -> dict[str, Path]:
    """``{"sdist": ..., "work": ..., "3.10": wheel, ...}``: built as `make dist` builds them,
    for the supported Pythons found here; ``work`` has each wheel's build log."""
    if not (REPO / "overmind_lab" / "labextension" / "package.json").exists():
        pytest.fail("the JupyterLab extension is not built (make install builds it)")
    if not interpreters:
        pytest.skip(f"no supported Python ({', '.join(SUPPORTED)}) is installed here")
    out = tmp_path_factory.mktemp("dist")
    make("dist-files", f"DIST_DIR={out / 'dist'}", f"DIST_WORK={out / 'work'}",
         f"DIST_PYTHONS={' '.join(interpreters)}", timeout=1200)
    built = {"sdist": the_one((out / "dist").glob("overmind_lab-*.tar.gz")),
             "work": out / "work"}
    for version in interpreters:
        tag = "cp" + version.replace(".", "")
        built[version] = the_one((out / "dist").glob(f"overmind_lab-*-{tag}-{tag}-*.whl"))
    return built


def wheel_for(dist: dict[str, Path], interpreters: dict[str, Path], version: str) -> Path:
    """The wheel of ``version``; the test is skipped, saying why, where it has no Python."""
    if version not in interpreters:
        pytest.skip(f"python{version} is not installed here, so its wheel is neither built nor "
                    "tested (`make pythons` says how to get it; `make test` requires it)")
    return dist[version]


def test_the_supported_pythons_are_stated_once() -> None:
    """Note [Supported Pythons]: requires-python gives the oldest, the classifiers every one,
    and whatever else names a version follows them."""
    minors = [int(v.split(".")[1]) for v in SUPPORTED]
    assert SUPPORTED and all(v.startswith("3.") for v in SUPPORTED), SUPPORTED
    assert minors == list(range(minors[0], minors[0] + len(minors))), SUPPORTED
    assert PYPROJECT["project"]["requires-python"] == f">={SUPPORTED[0]}"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == f"py3{minors[0]}"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == SUPPORTED[0]
    cmake = (REPO / "CMakeLists.txt").read_text()
    assert re.search(rf"find_package\(Python {re.escape(SUPPORTED[0])} REQUIRED", cmake)
    # the Makefile builds a wheel for each: `make pythons` lists every one, found or not
    found, missing = make_pythons()
    assert sorted([*found, *missing], key=lambda v: int(v.split(".")[1])) == SUPPORTED
    readme = (REPO / "README.md").read_text()
    named = ", ".join(SUPPORTED[:-1]) + f" and {SUPPORTED[-1]}"
    assert f"CPython {named}" in readme


def test_a_missing_python_is_an_error_that_says_how_to_get_it() -> None:
    missing = make("pythons", "DIST_PYTHONS=3.99", check=False)
    assert missing.returncode != 0
    assert "make: Python 3.99 is missing: no python3.99 on PATH or in " in missing.stderr
    assert ("install it (pyenv install 3.99, or your system's python3.99 package) or name it: "
            "make pythons DIST_PYTHON_3.99=/path/to/python3.99") in missing.stderr
    named = make("pythons", f"DIST_PYTHONS={HERE}", f"DIST_PYTHON_{HERE}={REPO / 'nothing'}",
                 check=False)
    assert named.returncode != 0
    assert f"DIST_PYTHON_{HERE}={REPO / 'nothing'} is not an executable" in named.stderr
    assert make_pythons(f"DIST_PYTHONS={HERE}", f"DIST_PYTHON_{HERE}={PY}")[0] == {HERE: Path(PY)}


def test_one_version_everywhere() -> None:
    import importlib.metadata

    import overmind_lab

    version = overmind_lab.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc|\.dev)?\d*", version)
    assert json.loads((REPO / "package.json").read_text())["version"] == version
    # pyproject.toml states no version of its own: it reads __init__.py's
    pyproject = (REPO / "pyproject.toml").read_text()
    assert not re.search(r"(?m)^version\s*=", pyproject)
    assert re.search(r'(?m)^dynamic = \["version"\]$', pyproject)
    assert 'metadata.version.input = "overmind_lab/__init__.py"' in pyproject
    assert importlib.metadata.version("overmind-lab") == version
    built = REPO / "overmind_lab" / "labextension" / "package.json"
    if built.exists():
        assert json.loads(built.read_text())["version"] == version


def test_the_sdist_carries_the_prebuilt_extension(dist: dict[str, Path]) -> None:
    with tarfile.open(dist["sdist"]) as tar:
        names = {n.partition("/")[2] for n in tar.getnames()}
        pkg_info = tar.extractfile(next(m for m in tar.getmembers()
                                        if m.name.count("/") == 1
                                        and m.name.endswith("/PKG-INFO")))
        assert pkg_info is not None
        meta = email.parser.Parser().parsestr(pkg_info.read().decode())
    assert {"LICENSE", "install.json", "overmind_lab/labextension/package.json",
            "native/portable.cpp", "CMakeLists.txt"} <= names
    assert any(re.fullmatch(r"overmind_lab/labextension/static/remoteEntry\.\w+\.js", n)
               for n in names)
    assert not any(n.startswith(("node_modules/", ".venv/", "build/", "benchmarks/",
                                 "overmind_lab/bench/")) for n in names)
    assert meta["License-Expression"] == "BSD-3-Clause"


@pytest.mark.parametrize("python", SUPPORTED)
def test_the_wheel_is_manylinux_with_license_and_install_json(
        dist: dict[str, Path], interpreters: dict[str, Path], python: str) -> None:
    import overmind_lab

    wheel = wheel_for(dist, interpreters, python)
    version = overmind_lab.__version__
    tag = "cp" + python.replace(".", "")
    assert wheel.name == f"overmind_lab-{version}-{tag}-{tag}-{PLAT}.whl", wheel.name
    # built from the sdist by that Python, without Node.js: the extension came prebuilt
    log = (dist["work"] / f"wheel-{python}.log").read_text()
    assert "JupyterLab extension is up to date" in log, log[-3000:]
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"overmind_lab-{version}.dist-info"
        meta = email.parser.Parser().parsestr(zf.read(f"{info}/METADATA").decode())
        tags = [line for line in zf.read(f"{info}/WHEEL").decode().splitlines()
                if line.startswith("Tag:")]
        data = f"overmind_lab-{version}.data/data"
        install = json.loads(zf.read(
            f"{data}/share/jupyter/labextensions/overmind-lab/install.json"))
        lab_version = json.loads(zf.read(
            f"{data}/share/jupyter/labextensions/overmind-lab/package.json"))["version"]
    assert tags == [f"Tag: {tag}-{tag}-{PLAT}"], tags
    assert f"overmind_lab/_native.cpython-{tag[2:]}-x86_64-linux-gnu.so" in names
    assert f"{info}/licenses/LICENSE" in names
    assert f"{data}/etc/jupyter/jupyter_server_config.d/overmind_lab.json" in names
    assert install["packageName"] == "overmind-lab" and install["packageManager"] == "python"
    assert meta["Version"] == lab_version == version
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["Author"] and meta["Project-URL"]
    assert {"torch", "diffusers", "transformers", "jupyter", "bench", "all"} <= set(
        meta.get_all("Provides-Extra") or [])
    # [all] is every feature of the package, not the benchmark suite's extra
    assert [r for r in meta.get_all("Requires-Dist") or [] if r.endswith('extra == "all"')] == [
        'overmind-lab[diffusers,jupyter,transformers]; extra == "all"']
    assert meta["Requires-Python"] == f">={SUPPORTED[0]}"
    # the native module needs nothing newer than the tag says (auditwheel checked it too)
    assert not any("labextension/" in n and n.startswith("overmind_lab/") for n in names)
    # the benchmark suite and its model builders stay in the checkout
    assert not any(n.startswith(("benchmarks/", "overmind_lab/bench/")) for n in names)


# Note [A venv that downloads nothing]: the new venv is made by this interpreter (so the
# same Python), without pip, and its site-packages holds one .pth file naming a directory
# of symlinks to this environment's packages, all but overmind-lab itself and every .pth
# file (the editable install's import hook among them). So it has the wheel as its only
# overmind_lab, the dependencies resolved from what is installed here (torch, Jupyter),
# its own prefix for the Jupyter data and config the wheel installs, and pip, which
# installs `--no-deps` from the file. Nothing is downloaded; it takes seconds.
def _venv(root: Path, keep: set[str] | None = None) -> Path:
    """A new venv at ``root`` that sees this environment's packages (all but ours), or
    only the distributions named in ``keep`` (and pip)."""
    run([PY, "-m", "venv", "--without-pip", root])
    ours = Path(sysconfig.get_paths()["purelib"])
    deps = root / "deps"
    deps.mkdir()
    keep_top: set[str] | None = None
    if keep is not None:
        import importlib.metadata

        keep_top = set()
        for name in {*keep, "pip"}:
            dist = importlib.metadata.distribution(name)
            for f in dist.files or ():
                keep_top.add(str(f).split("/")[0])
    for entry in ours.iterdir():
        name = entry.name
        if name.endswith(".pth") or "overmind_lab" in name or name == "__pycache__":
            continue
        if keep_top is not None and name not in keep_top:
            continue
        (deps / name).symlink_to(entry)
    site = Path(run([root / "bin" / "python", "-c",
                     "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                    ).stdout.strip())
    (site / "_overmind_test_deps.pth").write_text(f"{deps}\n")
    return root


def _script(venv: Path, name: str) -> None:
    """This environment's console script ``name``, run by the venv's interpreter."""
    text = (BIN / name).read_text().split("\n", 1)[1]
    path = venv / "bin" / name
    path.write_text(f"#!{venv / 'bin' / 'python'}\n{text}")
    path.chmod(0o755)


def _env(tmp: Path, venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JUPYTER", "OVERMIND_LAB_", "VIRTUAL_ENV", "PYTHON"))}
    env.update({
        "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "HOME": str(tmp / "home"), "XDG_CACHE_HOME": str(tmp / "home" / ".cache"),
        "JUPYTER_DATA_DIR": str(tmp / "home" / "data"),
        "JUPYTER_CONFIG_DIR": str(tmp / "home" / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "home" / "runtime"),
        "OVERMIND_LAB_SOCKET": str(tmp / "run" / "d.sock"),
        "OVERMIND_LAB_CACHE_DIR": str(tmp / "home" / "cache"),
        "JUPYTER_PLATFORM_DIRS": "1",
    })
    (tmp / "home").mkdir(exist_ok=True)
    return env


def _installed(wheel: Path, tmp: Path, name: str = "venv",
               keep: set[str] | None = None) -> tuple[Path, dict[str, str]]:
    """A new venv (``_venv``) with the wheel installed in it, and the environment to use."""
    venv = _venv(tmp / name, keep)
    env = _env(tmp, venv)
    run([venv / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index",
         wheel], env=env, cwd=tmp)
    return venv, env


def _pip_installed(python: Path, wheel: Path, tmp: Path) -> tuple[Path, dict[str, str]]:
    """A new venv of ``python`` with ``pip install WHEEL`` done as a user does it (its
    dependencies from the package index), and the environment to use."""
    venv = tmp / "venv"
    run([python, "-m", "venv", venv])
    pip_env = {k: v for k, v in os.environ.items()
               if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    run([venv / "bin" / "python", "-m", "pip", "install", "--quiet",
         "--disable-pip-version-check", wheel], env=pip_env, cwd=tmp)
    return venv, _env(tmp, venv)


LOAD = """
import json, sys
import overmind_lab
sys.path.insert(0, sys.argv[1])
import om_install_model as m
with overmind_lab.record_loads() as events:
    t = overmind_lab.load(m.make, 4096)
print(json.dumps({"file": overmind_lab.__file__, "outcome": events[0].outcome,
                  "sum": float(t["weight"].sum())}))
"""

MODEL = """
import torch

def make(n):
    return {"weight": torch.arange(n, dtype=torch.float32).reshape(64, -1)}
"""


def test_a_new_venv_gets_everything_from_the_wheel(dist: dict[str, Path],
                                                    interpreters: dict[str, Path],
                                                    tmp_path: Path) -> None:
    venv, env = _installed(wheel_for(dist, interpreters, HERE), tmp_path)
    vpy = venv / "bin" / "python"
    for name in ("jupyter", "jupyter-labextension", "jupyter-server"):
        _script(venv, name)
    sock = tmp_path / "run" / "d.sock"
    try:
        # the lab extension, named with its Python package (install.json)
        labext = run([venv / "bin" / "jupyter", "labextension", "list"], env=env, cwd=tmp_path)
        text = plain(labext)
        assert str(venv / "share" / "jupyter" / "labextensions") in text
        line = next(ln for ln in text.splitlines() if "overmind-lab" in ln and " v" in ln)
        assert "enabled" in line and "OK" in line and "(python, overmind-lab)" in line, text
        server = run([venv / "bin" / "jupyter", "server", "extension", "list"], env=env, cwd=tmp_path)
        text = plain(server)
        assert re.search(r"overmind_lab\._jupyter_server\s+enabled", text), text
        assert re.search(r"overmind_lab\._jupyter_server\s+OK", text), text
        # the warm kernelspec, for this user, with the venv's interpreter
        run([venv / "bin" / "overmind-lab", "kernel", "install", "--user"], env=env, cwd=tmp_path)
        spec = tmp_path / "home" / "data" / "kernels" / "overmind-lab-warm" / "kernel.json"
        kernel = json.loads(spec.read_text())
        assert kernel["argv"][0] == str(vpy)
        assert kernel["metadata"]["kernel_provisioner"]["provisioner_name"] == \
            "overmind-lab-warm"
        # a cold load, then a warm one in a second process, on the venv's own daemon
        (tmp_path / "om_install_model.py").write_text(MODEL)
        first, second = (json.loads(run([vpy, "-c", LOAD, tmp_path], env=env, cwd=tmp_path)
                                    .stdout.strip().splitlines()[-1]) for _ in range(2))
        site = run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   env=env, cwd=tmp_path).stdout.strip()
        assert first["file"].startswith(site) and second["file"].startswith(site)
        assert (first["outcome"], second["outcome"]) == ("cold", "warm")
        assert first["sum"] == second["sum"] == sum(range(4096))
        status = json.loads(run([venv / "bin" / "overmind-lab", "status", "--json"],
                                env=env, cwd=tmp_path).stdout)
        assert status["running"] and status["entries"] == 1
        run([venv / "bin" / "overmind-lab", "stop"], env=env, cwd=tmp_path)
        # uninstall: the kernelspec (ours), then the package (pip's)
        run([venv / "bin" / "overmind-lab", "kernel", "uninstall"], env=env, cwd=tmp_path)
        assert not spec.parent.exists()
        run([vpy, "-m", "pip", "uninstall", "-y", "overmind-lab"], env=env, cwd=tmp_path)
        assert not (venv / "bin" / "overmind-lab").exists()
        assert not (venv / "share" / "jupyter" / "labextensions" / "overmind-lab").exists()
        assert not (venv / "etc" / "jupyter" / "jupyter_server_config.d" /
                    "overmind_lab.json").exists()
        assert not (Path(site) / "overmind_lab").exists()
    finally:
        Client(sock).stop()


def test_bench_measures_a_model_folder_from_the_wheel(dist: dict[str, Path],
                                                     interpreters: dict[str, Path],
                                                     tmp_path: Path) -> None:
    from diffusers import UNet2DModel

    from tests.test_measure import check_output, no_daemon_on

    venv, env = _installed(wheel_for(dist, interpreters, HERE), tmp_path)
    vpy = venv / "bin" / "python"
    UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
                block_out_channels=(8, 16), norm_num_groups=4,
                down_block_types=("DownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "UpBlock2D")).save_pretrained(tmp_path / "unet")
    # the suite (benchmarks/) stays in the checkout: the wheel's command works without it
    found = run([vpy, "-c", "import importlib.util as u; print(u.find_spec('benchmarks'))"],
                env=env, cwd=tmp_path)
    assert found.stdout.strip() == "None"
    bench = run([venv / "bin" / "overmind-lab", "bench", tmp_path / "unet", "--repeat", "1"],
                env=env, cwd=tmp_path, timeout=600)
    assert "UNet2DModel (diffusers)" in bench.stdout
    no_daemon_on(check_output(bench.stdout))
    assert not (tmp_path / "run" / "d.sock").exists()  # the venv's own daemon: never started


#: Imports every module of the installed package but ``__main__`` ones; prints those that
#: failed, with the error, but for a module that needs an extra that is not installed.
IMPORT_ALL = """
import importlib, pkgutil, sys
import overmind_lab
from overmind_lab._extras import EXTRAS
optional = {m.split(".")[0] for mods in EXTRAS.values() for m in mods}
failed = {}
for info in pkgutil.walk_packages(overmind_lab.__path__, "overmind_lab."):
    if info.name.rpartition(".")[2] == "__main__":
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in optional:
            failed[info.name] = repr(exc)
    except Exception as exc:
        failed[info.name] = repr(exc)
print(sys.version_info[:2], overmind_lab.__file__, failed)
"""


# Note [A fork while the thread imports] (``_loading/prewarm.py``), on each Python: a fork right
# after ``import overmind_lab`` prints nothing and its child imports what the thread was
# importing; a fork beside a thread of the user's still warns from 3.12 on (the warning is theirs).
FORK_AT_ONCE = """
import os, threading, warnings
import overmind_lab
from overmind_lab._loading import prewarm
alive, n = prewarm._thread.is_alive(), len(warnings.filters)
pid = os.fork()
if pid == 0:
    from overmind_lab._loading import keys, load, user_code
    keys.prewarm()
    os._exit(0 if len(warnings.filters) == n else 1)
assert os.waitpid(pid, 0)[1] == 0
prewarm.wait(60)
assert len(warnings.filters) == n, warnings.filters[:1]
threading.Thread(target=threading.Event().wait, args=(60,), daemon=True).start()
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print(alive)
"""


@pytest.mark.parametrize("python", SUPPORTED)
def test_a_bare_install_names_the_extra_and_starts_no_daemon(
        dist: dict[str, Path], interpreters: dict[str, Path], python: str,
        tmp_path: Path) -> None:
    """`pip install overmind-lab` (dill and psutil only) on each supported Python."""
    import overmind_lab

    wheel = wheel_for(dist, interpreters, python)
    venv, env = _pip_installed(interpreters[python], wheel, tmp_path)
    env["OVERMIND_LAB_PREWARM"] = "0"
    vpy = venv / "bin" / "python"
    cli = venv / "bin" / "overmind-lab"
    sock = tmp_path / "run" / "d.sock"
    try:
        assert run([vpy, "-c", "import torch"], env=env, check=False, cwd=tmp_path).returncode == 1
        site = Path(run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        env=env, cwd=tmp_path).stdout.strip())
        # every module compiles for this Python, and imports unless it needs an extra
        run([vpy, "-m", "compileall", "-q", site / "overmind_lab"], env=env, cwd=tmp_path)
        imported = run([vpy, "-c", IMPORT_ALL], env=env, cwd=tmp_path).stdout.strip()
        major, minor = python.split(".")
        assert imported == f"({major}, {minor}) {site / 'overmind_lab' / '__init__.py'} {{}}"
        helped = run([cli, "--help"], env=env, cwd=tmp_path)
        assert helped.stdout.startswith("usage: overmind-lab ")
        assert run([cli, "--version"], env=env, cwd=tmp_path).stdout.split()[-1] == \
            overmind_lab.__version__
        install = run([cli, "kernel", "install", "--user"], env=env, check=False, cwd=tmp_path)
        assert install.returncode == 1
        assert install.stderr.strip() == (
            "overmind-lab: the warm kernel needs jupyter_client and ipykernel, which are not "
            'installed here: pip install "overmind-lab[jupyter]"'), install.stderr
        (tmp_path / "unet").mkdir()
        (tmp_path / "unet" / "config.json").write_text('{"_class_name": "UNet2DModel"}')
        bench = run([cli, "bench", tmp_path / "unet"], env=env, check=False, cwd=tmp_path)
        assert bench.returncode == 1 and "Traceback" not in bench.stderr
        assert 'pip install "overmind-lab[diffusers]"' in bench.stderr
        load = run([vpy, "-c", "import overmind_lab\n"
                    "try:\n    overmind_lab.load(len, [1, 2])\n"
                    "except overmind_lab.MissingDependency as exc:\n    print(exc)\n"],
                   env=env, cwd=tmp_path)
        assert load.stdout.strip() == ("overmind_lab.load() needs torch, which is not "
                                       'installed here: pip install "overmind-lab[torch]"')
        alive = 0
        for _ in range(4):
            forked = run([vpy, "-c", FORK_AT_ONCE], env={**env, "OVERMIND_LAB_PREWARM": "1"},
                         cwd=tmp_path)
            alive += forked.stdout.strip() == "True"
            warned = forked.stderr.count("is multi-threaded, use of fork()")
            new = tuple(map(int, python.split("."))) >= (3, 12)  # warns of threads at a fork
            assert warned == (1 if new else 0), forked.stderr
            assert warned == 0 or "<string>:15:" in forked.stderr, forked.stderr  # the 2nd fork
        assert alive  # some forks did come while the thread worked
        # the CLI's own commands work without extras; none of the above started a daemon
        status = run([cli, "status"], env=env, check=False, cwd=tmp_path)
        assert status.returncode == 3 and "not running" in status.stdout
        assert not sock.exists() and not list((tmp_path / "run").glob("*.sock"))
    finally:
        Client(sock).stop()
        shutil.rmtree(tmp_path / "home", ignore_errors=True)
