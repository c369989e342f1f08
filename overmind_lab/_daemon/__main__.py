"""``python -m overmind_lab._daemon serve [--detach] [--socket PATH] [--budget SIZE]
[--cache-dir DIR]``: the daemon as a client starts it (``Client._spawn``), without the command
line's parser and the modules the other commands need (Note [A daemon that starts at once]).
Users run ``overmind-lab serve``, which takes the same options and says what it started."""

from __future__ import annotations

import sys

USAGE = ("usage: python -m overmind_lab._daemon serve [--detach] [--socket PATH] "
         "[--budget SIZE] [--cache-dir DIR] (`overmind-lab serve --help` says more)")


class ServeOptions:
    """``serve``'s options, as ``process.add_serve_arguments`` names them."""

    def __init__(self) -> None:
        self.socket: str | None = None
        self.budget: str | None = None
        self.cache_dir: str | None = None
        self.detach = False


# Note [A daemon that starts at once]: a client that finds no daemon waits until ``serve
# --detach`` says the daemon listens: the first load of a login (where ``patch_all`` did not start
# it ahead) and the first load after a daemon died pay for it. It took 155 ms, of which the
# command line's parser and the modules ``cli`` imports for its other commands took 14 ms,
# ``importlib.metadata`` 17 ms (now imported by the package watch, in its thread; the saved
# entries' versions come from folder names: Note [Versions without METADATA]), ``ssl`` 7 ms,
# ``secrets`` 4.5 ms (its ``hmac`` loads OpenSSL) and ``statistics`` 3 ms (now at the first
# median): 90-95 ms now, of which Python's own start is 12 ms and asyncio's import 30 ms.
def serve_options(words: list[str]) -> ServeOptions | None:
    """The options after ``serve``; ``None`` where they are not ``serve``'s."""
    options = ServeOptions()
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--detach":
            options.detach = True
            i += 1
            continue
        name, eq, value = word.partition("=")
        if name not in ("--socket", "--budget", "--cache-dir"):
            return None
        if not eq:
            if i + 1 >= len(words):
                return None
            value = words[i + 1]
            i += 1
        if not value:
            return None
        setattr(options, name[2:].replace("-", "_"), value)
        i += 1
    return options


def main(words: list[str]) -> int:
    options = serve_options(words[1:]) if words[:1] == ["serve"] else None
    if options is None:
        print(USAGE, file=sys.stderr)
        return 2
    # The daemon serves a Unix socket and never speaks TLS; asyncio imports ssl only to offer
    # it (7 ms of the start). A None in sys.modules makes that import fail, which asyncio takes
    # as no ssl module (Note [A daemon that starts at once]).
    sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]
    from overmind_lab._daemon.process import serve_command

    return serve_command(options)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
