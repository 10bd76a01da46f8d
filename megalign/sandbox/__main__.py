"""`python -m megalign.sandbox PROGRAM [--timeout S] [--language python] [--stdin FILE]`: run one program file
exactly as a reward or tool would and print its outcome as JSON (for debugging rewards)."""
import argparse
import sys

from megalign.sandbox.core import LANGUAGES, Sandbox


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megalign.sandbox", description=__doc__)
    parser.add_argument("program", help="file with the program's source ('-' reads it from stdin)")
    parser.add_argument("--timeout", type=float, default=5.0, help="wall-clock seconds (CPU limit: rounded up)")
    parser.add_argument("--language", choices=sorted(LANGUAGES), default="python")
    parser.add_argument("--memory-mb", type=int, default=512, help="address-space limit (RLIMIT_AS)")
    parser.add_argument("--stdin", help="file given to the program as its standard input")
    args = parser.parse_args(argv)
    source = sys.stdin.read() if args.program == "-" else open(args.program, encoding="utf-8").read()
    stdin = open(args.stdin, encoding="utf-8").read() if args.stdin else ""
    outcome = Sandbox(timeout_s=args.timeout, memory_mb=args.memory_mb).run(source, stdin, args.language)
    print(outcome.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
