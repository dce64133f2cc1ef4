"""Suite-wide settings.

ORTModule exports in the test process (``ONNXTRAIN_EXPORT_PROCESS=in-process``) unless the run sets the variable:
by default a recompute budget exports in a child process (ortmodule/export_process.py), several seconds for each
schema's first export, and the suite builds hundreds; and a test's monkeypatch of what the export reads (a pass's
block size) does not reach a child. tests/ortmodule/test_export_process.py sets the option and the variable itself,
and tests the default rule.
"""

import os

os.environ.setdefault("ONNXTRAIN_EXPORT_PROCESS", "in-process")
