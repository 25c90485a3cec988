"""With this folder on PYTHONPATH and DUMP_AFTER_S=N set, every Python process started (the
engine's subprocesses too) writes all its threads' stacks to stderr N seconds after it starts:
where a hung run sits, even inside a C call that a signal-based timeout cannot interrupt."""

import faulthandler
import os
import sys

if os.environ.get("DUMP_AFTER_S"):
    faulthandler.dump_traceback_later(float(os.environ["DUMP_AFTER_S"]), file=sys.stderr)
