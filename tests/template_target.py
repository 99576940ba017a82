"""Run by tests/test_template.py through a process template (``python -m
tests.template_target CODE``): prints what it became as one JSON line, then exits with
status CODE, or is ended by signal -CODE."""

import json
import os
import signal
import sys

if __name__ == "__main__":
    with open("/proc/self/cmdline", "rb") as f:
        title = f.read().rstrip(b"\0").decode()
    print(json.dumps({"argv": sys.argv[1:], "title": title, "parent": os.getppid(), "cwd": os.getcwd(),
                      "mark": os.environ.get("TEMPLATE_TEST_MARK"), "owner_only": os.environ.get("TEMPLATE_OWNER_ONLY"),
                      "preloaded": "xml.dom.minidom" in sys.modules}), flush=True)
    code = int(sys.argv[1])
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)
