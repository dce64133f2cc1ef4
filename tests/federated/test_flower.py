"""The Flower apps (flwr 1.41, ``onnxtrain[flower]``): run by the `flower` tier of scripts/test.sh.

Marked slow and flower, so the default suite (which has no flwr) deselects them; in the tier a missing
flwr is a failure, not a skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.import_blocker import BLOCK_IMPORTS

pytestmark = [pytest.mark.slow, pytest.mark.flower]

OFFLINE = {"FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_TELEMETRY_ENABLED": "0"}

CLIENTAPP_SCRIPT = BLOCK_IMPORTS + textwrap.dedent("""
    sys.path.insert(0, sys.argv[2])
    import numpy as np
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity  # what a SuperNode sets in its ClientApp process

    from fedmlp.client_app import app
    from onnxtrain.federated import OnDeviceClient
    from onnxtrain.federated.flower import from_record, to_record

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1
    run_config = {"artifacts": sys.argv[1], "local-epochs": 1, "batch-size": 32, "learning-rate": 0.003}
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 3},
                      state=RecordDict(), run_config=run_config)
    start = OnDeviceClient(sys.argv[1]).initial_parameters()
    msg = Message(RecordDict({"arrays": to_record(start), "config": ConfigRecord({"server-round": 1})}),
                  dst_node_id=7, message_type="train")
    reply = app(msg, context)
    arrays = from_record(reply.content["arrays"])
    assert list(arrays) == list(start), list(arrays)
    assert reply.content["metrics"]["num-examples"] == 1200, reply.content["metrics"]
    assert any(not np.array_equal(arrays[k], start[k]) for k in start)

    msg = Message(RecordDict({"arrays": to_record(arrays)}), dst_node_id=7, message_type="evaluate")
    metrics = app(msg, context).content["metrics"]
    assert metrics["accuracy"] > 0.3 and metrics["num-examples"] == 300, metrics

    wrong = dict(list(arrays.items())[::-1])
    msg = Message(RecordDict({"arrays": to_record(wrong), "config": ConfigRecord({"server-round": 2})}),
                  dst_node_id=7, message_type="train")
    try:
        app(msg, context)
    except Exception as exc:  # the ClientApp's error: names the parameter at fault
        assert "another order: position 0 holds 'fc2.bias'" in str(exc), exc
    else:
        raise AssertionError("parameters in the wrong order were accepted")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("ok", metrics["accuracy"])
""")


def test_clientapp_trains_without_torch(fl_artifacts, example_path):
    result = subprocess.run([sys.executable, "-c", CLIENTAPP_SCRIPT, str(fl_artifacts), str(example_path)],
                            capture_output=True, text=True, timeout=180, check=False,
                            env={**os.environ, **OFFLINE})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("ok")


def test_loopback_deployment(example_path, tmp_path):
    """SuperLink + three SuperNodes on loopback, two rounds; the global accuracy rises each round."""
    script = example_path / "run_loopback.py"
    result = subprocess.run([sys.executable, str(script), "--rounds", "2", "--workdir", str(tmp_path),
                             "--port", "19192", "--timeout", "480"],
                            capture_output=True, text=True, timeout=540, check=False, env={**os.environ, **OFFLINE})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    accs = [float(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines()
            if line.startswith("federated round")]
    assert len(accs) == 3 and accs[0] < accs[1] < accs[2] and accs[2] > 0.5, result.stdout
