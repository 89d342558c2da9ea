"""Renders an HTML file with headless Chromium (Debian's ``chromium``
package): a PNG screenshot, the DOM after loading, and the console errors.
tests/test_report_html.py uses ``render``; so does tools/screenshot.py, which
made docs/report.png.
"""
import os
import re
import shutil
import subprocess
from typing import List, NamedTuple, Optional

_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
          "--enable-logging=stderr", "--v=0"]


class Rendered(NamedTuple):
    dom: str  # the page's DOM as Chromium serializes it after loading
    console_errors: List[str]  # the page's console errors (none for a clean page)


def chromium() -> Optional[str]:
    """The Chromium executable on PATH, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(html_path: str, png_path: Optional[str] = None, size: str = "1200,1800",
           timeout: float = 120) -> Rendered:
    """Loads ``html_path`` in headless Chromium; with ``png_path`` also writes
    a screenshot of ``size`` ("width,height") pixels."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("chromium not installed (apt-get install chromium)")
    url = "file://" + os.path.abspath(html_path)
    dump = subprocess.run([exe, *_FLAGS, "--dump-dom", url], capture_output=True, text=True,
                          timeout=timeout, check=True)
    if "Page load failed" in dump.stderr:
        raise RuntimeError(f"chromium could not load {url}: {dump.stderr.strip()[-300:]}")
    errors = [line for line in dump.stderr.splitlines()
              if re.search(r"CONSOLE|Uncaught|Failed to load", line)]
    if png_path is not None:
        png_path = os.path.abspath(png_path)
        if os.path.exists(png_path):
            os.remove(png_path)
        subprocess.run([exe, *_FLAGS, f"--screenshot={png_path}", f"--window-size={size}", url],
                       capture_output=True, timeout=timeout, check=True)
        if not os.path.exists(png_path):
            raise RuntimeError(f"chromium wrote no screenshot of {url}")
    return Rendered(dump.stdout, errors)
