"""A screenshot of an HTML file, with headless Chromium (tests/chromium.py).

    python tools/screenshot.py REPORT.html OUT.png [--size 1200,1400]

docs/report.png: ``PYTHONPATH=. python tools/report_example.py /tmp/report.html``, then
``python tools/screenshot.py /tmp/report.html docs/report.png``.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import chromium  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html")
    parser.add_argument("png")
    parser.add_argument("--size", default="1200,1400")
    opts = parser.parse_args()
    rendered = chromium.render(opts.html, opts.png, opts.size)
    for line in rendered.console_errors:
        print(line)
    print(f"wrote {opts.png}")


if __name__ == "__main__":
    main()
