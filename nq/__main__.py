"""`python -m nq` and the `nq` console script.

nq.cli is imported under nq.errors' signal handling, so a Ctrl-C while numpy and the loader
import (the first ~0.1 s) ends the run as quietly as one later does.
"""


def run() -> int:
    from nq.errors import interrupted, signals_as_interrupts
    try:
        with signals_as_interrupts():
            from nq.cli import main
            return main()
    except KeyboardInterrupt as e:  # before main's own handler, or a second Ctrl-C
        return interrupted(e)


if __name__ == "__main__":
    raise SystemExit(run())
