"""python -m torchcast {demo,track} ... (audit: another name for track)"""
import sys

from . import cli


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python -m torchcast demo\n"
             f"       {cli.usage()}\n"
             "       (audit: another name for track)")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from . import demo
        demo.run()
        return 0
    if command in cli.COMMANDS:
        return cli.main(rest)
    print(f"unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
