"""experiments._interrupt: a Ctrl-C gives one line on stderr and status 130, even where a
library swallows the SystemExit it raises, and unwinds through ``finally`` blocks."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SETUP = ("import os, signal, sys, time\n"
         "from experiments._interrupt import exit_on_interrupt\n"
         "exit_on_interrupt('demo')\n")


def _run(body: str, *, second_interrupt_after: float | None = None):
    proc = subprocess.Popen([sys.executable, "-c", SETUP + body], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if second_interrupt_after is not None:
        assert proc.stdout.readline() == "swallowed\n"  # the first Ctrl-C was swallowed
        time.sleep(second_interrupt_after)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_an_interrupt_unwinds_through_finally_with_one_line(tmp_path):
    marker = tmp_path / "cleaned"
    code, _, err = _run(f"try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n"
                        f"finally:\n    open({str(marker)!r}, 'w').close()\n")
    assert code == 130 and marker.exists()
    assert err == "demo: interrupted (Ctrl-C); no file was left half-written\n"


def test_a_swallowed_interrupt_still_ends_with_status_130():
    """A bare except around the interrupted code (as some optional imports have) goes on;
    the process ends normally but with 130 and the one line."""
    code, out, err = _run("try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n"
                          "except BaseException:\n    pass\nprint('went on')\n")
    assert (code, out) == (130, "went on\n")
    assert err == "demo: interrupted (Ctrl-C); no file was left half-written\n"


@pytest.mark.slow
def test_a_second_interrupt_after_a_swallowed_one_stops_at_once():
    start = time.monotonic()
    code, _, err = _run("try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n"
                        "except BaseException:\n    pass\nprint('swallowed', flush=True)\n"
                        "time.sleep(30)\n", second_interrupt_after=0.2)
    assert code == 130 and time.monotonic() - start < 20
    assert err == "demo: interrupted (Ctrl-C); no file was left half-written\n"


def test_a_swallowed_interrupt_keeps_the_atomic_writers_from_publishing(tmp_path):
    """The run goes on after a swallowed Ctrl-C, but neither writer renames its file into
    place: status 130, the one line, no file under either name and no temporary left."""
    csv, png = tmp_path / "t.csv", tmp_path / "t.png"
    code, out, err = _run(
        "from experiments._common import write_text\n"
        "from experiments.harness import write_csv\n"
        "import pandas as pd\n"
        "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(30)\n"
        "except BaseException:\n    pass\n"
        f"try:\n    write_text({str(png)!r}, 'x')\nexcept SystemExit:\n    print('refused')\n"
        f"write_csv(pd.DataFrame({{'a': [1.5, 2.5]}}), {str(csv)!r})\n"
        "print('not reached')\n")
    assert (code, out) == (130, "refused\n")
    assert err == "demo: interrupted (Ctrl-C); no file was left half-written\n"
    assert list(tmp_path.iterdir()) == []
