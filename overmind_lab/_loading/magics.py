"""IPython extension: ``%load_ext overmind_lab``.

::

    %load_ext overmind_lab
    %overmind_load                                  # cache from_pretrained in this kernel
    %overmind_load pipe = StableDiffusionPipeline.from_pretrained(path)
    warm 0.05 s (cold load was 2.91 s, 58x)  StableDiffusionPipeline.from_pretrained('/m')

    %timeit -n1 -r5 %overmind_load --cold pipe = StableDiffusionPipeline.from_pretrained(path)
    %timeit -n1 -r5 %overmind_load pipe = StableDiffusionPipeline.from_pretrained(path)

    %%overmind_load
    vae = AutoencoderKL.from_pretrained(path, subfolder="vae")
    pipe = StableDiffusionPipeline.from_pretrained(path, vae=vae)

    %overmind_status                                # the cache, as a table

To load it at every start: ``c.InteractiveShellApp.extensions = ["overmind_lab"]``.
"""

# IPython's magic_arguments and shell methods carry no annotations.
# mypy: disable-error-code="no-untyped-call,untyped-decorator"
from __future__ import annotations

import ast
import contextlib
import linecache
import re
from types import TracebackType
from typing import Any, Literal

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from overmind_lab._common.display import StatusReport, describe_load, status_line
from overmind_lab._common.messages import EntryJson

__all__ = ["OvermindMagics", "load_ipython_extension", "unload_ipython_extension"]

# Leading option words (``--cold -q``); the statement is the verbatim rest of the line, so quotes
# and spacing inside it reach Python untouched.
_OPTION = re.compile(r"\s*(-{1,2}[A-Za-z][\w-]*)(?=\s|$)")

_patched_by_extension = False


def _split_options(line: str) -> tuple[str, str]:
    """``"--cold pipe = f('a  b')"`` -> ``("--cold", "pipe = f('a  b')")``."""
    options: list[str] = []
    pos = 0
    while True:
        m = _OPTION.match(line, pos)
        if m is None:
            break
        options.append(m.group(1))
        pos = m.end()
    rest = line[pos:]
    stripped = rest.lstrip()
    if stripped.startswith("-- ") or stripped == "--":
        rest = stripped[2:]
    return " ".join(options), rest.strip()


@magics_class
class OvermindMagics(Magics):
    """``%overmind_load`` and ``%overmind_status``."""

    @magic_arguments()
    @argument("--cold", action="store_true",
              help="run the statement without the cache (the plain load, for comparisons)")
    @argument("--refresh", action="store_true",
              help="load from the source again and replace the cache entries")
    @argument("--verify", action="store_true",
              help="also load every hit plainly and compare (proof that the warm result "
                   "equals a plain load); alone, turns this on for the kernel")
    @argument("-q", "--quiet", action="store_true", help="print nothing")
    @argument("statement", nargs="*",
              help="Python statement to run with caching, e.g. "
                   "pipe = StableDiffusionPipeline.from_pretrained(path)")
    @line_cell_magic
    def overmind_load(self, line: str = "", cell: str | None = None) -> Any:
        """Cache ``from_pretrained`` in this kernel, or run a statement through the cache.

        ``%overmind_load`` alone patches diffusers and transformers (``patch_all()``) and prints
        the daemon status: after a kernel restart the same cell loads warm. ``%overmind_load
        <statement>`` also runs the statement in the user namespace and prints one line per
        load (``warm 0.05 s (cold load was 2.91 s, 58x)``); ``%%overmind_load`` does it for a
        cell. A final expression's value is returned. It works inside ``%timeit``::

            %timeit -n1 -r5 %overmind_load --cold pipe = Pipe.from_pretrained(path)
            %timeit -n1 -r5 %overmind_load pipe = Pipe.from_pretrained(path)
        """
        options, statement = _split_options(line)
        args = parse_argstring(self.overmind_load, options)
        if args.cold and args.refresh:
            raise UsageError(
                "--cold and --refresh exclude each other: --cold skips the cache, "
                "--refresh replaces its entries."
            )
        if args.verify and (args.cold or args.refresh):
            other = "--cold" if args.cold else "--refresh"
            raise UsageError(
                f"--verify and {other} exclude each other: --verify checks warm hits "
                f"against a plain load, and {other} makes no warm hit."
            )
        if cell is not None and statement:
            raise UsageError(
                "%%overmind_load takes only options on its first line; put the statements "
                f"in the cell body (got {statement!r})."
            )
        source = cell if cell is not None else statement
        _ensure_patched()
        if not source.strip():
            if args.verify:
                import overmind_lab

                overmind_lab.patch_all(verify=True)
                if not args.quiet:
                    print("overmind-lab: verify mode on in this kernel: every warm hit is "
                          "also loaded plainly and compared")
                return None
            if args.cold or args.refresh:
                flag = "--cold" if args.cold else "--refresh"
                raise UsageError(
                    f"{flag} needs a statement, e.g. "
                    f"%overmind_load {flag} pipe = StableDiffusionPipeline.from_pretrained(path)"
                )
            if not args.quiet:
                print(_kernel_status())
            return None
        try:
            return self._run(source, cold=args.cold, refresh=args.refresh, verify=args.verify,
                             quiet=args.quiet)
        except BaseException as error:
            statement_frames = _statement_traceback(error)
            if statement_frames is False:
                raise  # not the statement's: ours, whole
            # Note [The statement's own traceback]: IPython hides this frame (the magic is part of
            # the cell's line, as IPython's own frames are); below it, the statement's frames.
            __tracebackhide__ = True  # noqa: F841 - read by IPython from the frame's locals
            error.with_traceback(statement_frames)
            raise error  # the statement's own exception, its frames below

    @magic_arguments()
    @line_magic
    def overmind_status(self, line: str = "") -> StatusReport:
        """Show the cache: every entry with its size, hits and cold vs warm load times (HTML in a
        notebook, text in a terminal); ``.status`` and ``.entries`` hold the JSON."""
        parse_argstring(self.overmind_status, line)
        import overmind_lab

        client = overmind_lab.Client()
        status = client.status()
        entries: list[EntryJson] = []
        if status.get("running"):
            try:
                entries = client.entries()
            except overmind_lab.OvermindError as exc:
                status = {**status, "error": str(exc)}
        return StatusReport(status, entries)

    # ---------------------------------------------------------------------------------

    def _run(self, source: str, *, cold: bool, refresh: bool, verify: bool, quiet: bool) -> Any:
        import overmind_lab

        mode: contextlib.AbstractContextManager[Any]
        if cold:
            mode = overmind_lab.bypass()
        elif refresh:
            mode = overmind_lab.refreshing()
        elif verify:
            mode = overmind_lab.verifying()
        else:
            mode = contextlib.nullcontext()
        with overmind_lab.record_loads() as events, mode:
            result = self._execute(source)
        if not quiet:
            for event in events:
                print(describe_load(event))
            if not events:
                print(
                    "overmind-lab: no cached load ran in this statement (only "
                    "from_pretrained / from_single_file and overmind_lab.load() are cached)"
                )
        return result

    def _execute(self, source: str) -> Any:
        """Run ``source`` in the user namespace, like ``%time`` (``run_cell`` inside ``%timeit``
        would start a nested cell execution per repeat)."""
        shell = self.shell
        assert shell is not None
        code = shell.transform_cell(source)
        filename = _statement_file(code)
        tree = shell.transform_ast(shell.compile.ast_parse(code, filename))
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        namespace = shell.user_ns
        exec(shell.compile(tree, filename, "exec"), namespace)  # noqa: S102 - the user's own statement
        if last is not None:
            compiled = shell.compile(last, filename, "eval")  # type: ignore[arg-type]
            return eval(compiled, namespace)
        return None


# Note [The statement's own traceback]: the statement runs as code compiled from a string, so its
# frame's source is registered in ``linecache`` under a name of its own, ``<%overmind_load-N>``
# (one per distinct statement, never evicted: ``mtime`` None, as IPython caches a cell), and a
# traceback shows the user's statement, not "Could not get source". An exception that passed
# through the statement (the loader's, or the user's own code's) is re-raised by the magic with
# the traceback from the statement's frame down: the magic's frames are left out, and the
# one left (the re-raise) carries ``__tracebackhide__``, which IPython's display honours; a
# patched ``from_pretrained`` or ``load`` below has cut its own (Note [Tracebacks that show the
# user's code] in ``load``). A ``SyntaxError`` in the statement keeps no frame of ours either.
# An exception that never reached the statement (a ``UsageError``, a failure of ours) is
# re-raised whole.
_statement_files: dict[str, str] = {}


def _statement_file(code: str) -> str:
    """The ``linecache`` name of a statement's source (registered on first use)."""
    name = _statement_files.get(code)
    if name is None:
        name = f"<%overmind_load-{len(_statement_files) + 1}>"
        lines = [line + "\n" for line in code.splitlines()]
        linecache.cache[name] = (len(code), None, lines, name)
        _statement_files[code] = name
    return name


def _statement_traceback(error: BaseException) -> TracebackType | None | Literal[False]:
    """The traceback from the statement's frame down (Note [The statement's own traceback]);
    ``None`` for a ``SyntaxError`` of the statement; ``False`` when the statement never ran."""
    names = set(_statement_files.values())
    if isinstance(error, SyntaxError) and error.filename in names:
        return None
    entry = error.__traceback__
    while entry is not None:
        if entry.tb_frame.f_code.co_filename in names:
            return entry
        entry = entry.tb_next
    return False

def _ensure_patched() -> None:
    global _patched_by_extension
    from overmind_lab._loading.patch import is_patched, patch_all

    if not is_patched():
        # the libraries installed here: a kernel with torch alone still runs
        # ``%overmind_load x = overmind_lab.load(my_loader, ...)``
        from overmind_lab._extras import missing

        absent = missing(("diffusers", "transformers"))
        patch_all(diffusers="diffusers" not in absent, transformers="transformers" not in absent)
        _patched_by_extension = True


def _kernel_status() -> str:
    """Two lines: what is patched, and where the daemon stands (starting it if needed)."""
    import overmind_lab

    head = "overmind-lab: from_pretrained of diffusers and transformers is cached in this kernel"
    client = overmind_lab.Client()
    try:
        status = client.start()
    except (overmind_lab.OvermindError, OSError) as exc:  # as load() does: never fail
        return f"{head}.\ndaemon unavailable, loads run uncached: {exc}"
    return f"{head}.\n{status_line(status)}"


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext overmind_lab``: register the magics (patching waits for ``%overmind_load``)."""
    ipython.register_magics(OvermindMagics)
    from overmind_lab._loading.patch import _prewarm_go

    _prewarm_go()  # Note [The thread waits its turn] (``prewarm``)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext overmind_lab``: undo the patching the magics did."""
    global _patched_by_extension
    if _patched_by_extension:
        from overmind_lab._loading.patch import unpatch_all

        unpatch_all()
        _patched_by_extension = False
    registered = ipython.magics_manager.magics
    for kind in ("line", "cell"):
        for name in ("overmind_load", "overmind_status"):
            registered[kind].pop(name, None)
